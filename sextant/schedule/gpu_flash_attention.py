"""placeholder"""
def flash_refusal(group, target):
    return "not yet"
def gpu_flash_attention_kernel(*a): raise NotImplementedError
