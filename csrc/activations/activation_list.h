// The activations of the family: the one list that every file of the family
// (schemas, typed handles, descriptors, the kernel of each dispatch key,
// routes) and the Python side (batchrules.activations, through
// _C._activations()) expand. Adding an activation is one entry here plus its
// second derivative in definitions.cpp; see activations/README.md.
//
// _(name, Name, supports_complex, formula):
//   name              the op batchrules::<name> and its backward <name>_backward,
//                     computed by ATen's at::<name> / at::<name>_backward, and
//                     the aten::<name> that routing sends to batchrules::<name>
//   Name              for the autograd nodes' names: Batchrules<Name>Backward0
//   supports_complex  whether the forward kernels take complex tensors (as ATen's)
//   formula           f(input) in Python, for the docstrings
#pragma once

#define BATCHRULES_ACTIVATIONS(_)                                    \
  _(silu, Silu, /*supports_complex=*/true, "input * sigmoid(input)") \
  _(mish, Mish, /*supports_complex=*/false, "input * tanh(softplus(input))")
