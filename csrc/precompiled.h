// torch's headers that most of csrc includes, compiled once per build into a
// precompiled header that every file is compiled with (setup.py, Note
// [Precompiled torch headers]). Not included by any source: each file still
// includes what it uses, so a build without it (BATCHRULES_PCH=0, or a
// compiler other than GCC) compiles the same code.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/functorch/BatchedTensorImpl.h>
#include <ATen/functorch/DynamicLayer.h>
#include <ATen/functorch/PlumbingHelper.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>
