"""flash_attn.utils.distributed's ``all_gather``, which OpenRLHF imports (package docstring): import only."""


def all_gather(*args, **kwargs):
    raise RuntimeError("flash_attn.utils.distributed.all_gather: flash-attn is not installed (CPU stand-in)")
