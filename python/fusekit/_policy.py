"""The dispatch decision of fusekit.torch on GPUs without fusekit kernels, kept free of PyTorch so
that it is tested on any machine (fusekit.torch.set_fallback documents the policies)."""

#: The policies fusekit.torch.set_fallback takes.
POLICIES = ("auto", "strict", "always")


def decide(policy: str, device_type: str, supported: bool) -> str:
    """'fusekit' or 'pytorch' for a call on tensors of `device_type` ('cpu', 'cuda', ...), where
    `supported` says whether fusekit has kernels for that GPU; 'error' under 'strict' where it has
    none. CPU tensors run fusekit's float64 reference unless the policy is 'always'."""
    if policy not in POLICIES:
        raise ValueError(f"unknown fallback policy {policy!r}; expected one of {POLICIES}")
    if policy == "always":
        return "pytorch"
    if device_type != "cuda" or supported:
        return "fusekit"
    return "error" if policy == "strict" else "pytorch"
