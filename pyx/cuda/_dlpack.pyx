"""DLPack capsules over device memory (the legacy ``dltensor`` protocol).

Built as ``cellcache.cuda._dlpack``. ``DeviceBuffer.__dlpack__`` in
:mod:`cellcache.cuda.backend` hands a consumer (``torch.from_dlpack``) a capsule that keeps
the buffer's owner alive until the consumer releases the tensor. The DLPack structs are
declared here in plain C (the legacy ``DLManagedTensor`` layout of ``dlpack.h``), so no
header is needed; nothing here calls the driver.
"""

from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport uint64_t
from libc.stdlib cimport free, malloc

cdef extern from *:
    """
    typedef struct { int device_type; int device_id; } cc_DLDevice;
    typedef struct { unsigned char code; unsigned char bits; unsigned short lanes; } cc_DLDataType;
    typedef struct {
        void* data; cc_DLDevice device; int ndim; cc_DLDataType dtype;
        long long* shape; long long* strides; unsigned long long byte_offset;
    } cc_DLTensor;
    typedef struct cc_DLManagedTensor {
        cc_DLTensor dl_tensor; void* manager_ctx;
        void (*deleter)(struct cc_DLManagedTensor*);
    } cc_DLManagedTensor;
    """
    ctypedef struct cc_DLDevice:
        int device_type
        int device_id
    ctypedef struct cc_DLDataType:
        unsigned char code
        unsigned char bits
        unsigned short lanes
    ctypedef struct cc_DLTensor:
        void* data
        cc_DLDevice device
        int ndim
        cc_DLDataType dtype
        long long* shape
        long long* strides
        unsigned long long byte_offset
    ctypedef struct cc_DLManagedTensor:
        cc_DLTensor dl_tensor
        void* manager_ctx
        void (*deleter)(cc_DLManagedTensor*) noexcept


cdef void _dl_deleter(cc_DLManagedTensor* m) noexcept with gil:
    if m == NULL:
        return
    Py_DECREF(<object>m.manager_ctx)
    free(m.dl_tensor.shape)
    free(m)


cdef void _capsule_destructor(object capsule) noexcept:
    cdef cc_DLManagedTensor* m
    if PyCapsule_IsValid(capsule, b"dltensor"):       # never consumed: we still own it
        m = <cc_DLManagedTensor*>PyCapsule_GetPointer(capsule, b"dltensor")
        _dl_deleter(m)


#: DLPack's device type of CUDA device memory (kDLCUDA)
KDL_CUDA = 2


def dlpack_capsule(owner, uint64_t ptr, tuple shape, int code, int bits, int device_id):
    """A legacy ``dltensor`` capsule over device memory at ``ptr`` (C-contiguous, no strides).

    ``owner`` is kept alive until the consumer releases the tensor.
    """
    cdef cc_DLManagedTensor* m = <cc_DLManagedTensor*>malloc(sizeof(cc_DLManagedTensor))
    cdef int i, ndim = len(shape)
    if m == NULL:
        raise MemoryError()
    m.dl_tensor.shape = <long long*>malloc(sizeof(long long) * (ndim if ndim else 1))
    if m.dl_tensor.shape == NULL:
        free(m)
        raise MemoryError()
    for i in range(ndim):
        m.dl_tensor.shape[i] = shape[i]
    m.dl_tensor.data = <void*><size_t>ptr
    m.dl_tensor.device.device_type = KDL_CUDA
    m.dl_tensor.device.device_id = device_id
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype.code = code
    m.dl_tensor.dtype.bits = bits
    m.dl_tensor.dtype.lanes = 1
    m.dl_tensor.strides = NULL
    m.dl_tensor.byte_offset = 0
    Py_INCREF(owner)
    m.manager_ctx = <void*>owner
    m.deleter = _dl_deleter
    return PyCapsule_New(m, b"dltensor", _capsule_destructor)
