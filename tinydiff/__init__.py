"""tinydiff: a small, tested reference for masked diffusion LMs and fast-inference methods."""
