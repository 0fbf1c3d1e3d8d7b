from typing import Any

KDL_CUDA: int

def dlpack_capsule(
    owner: object, ptr: int, shape: tuple[int, ...], code: int, bits: int, device_id: int
) -> Any: ...
