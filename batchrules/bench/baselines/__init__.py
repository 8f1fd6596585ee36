"""What the bench measures batchrules against besides stock torch.func: the
hand-written limits (what an expert writes without vmap) and Opacus."""
