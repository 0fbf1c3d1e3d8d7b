"""GPU tests: marked ``gpu``; skipped only when cuda-bindings, the driver or a device is
missing (the ctypes probe). Any other failure of the probe fails the tests."""

import pytest

from cellcache.cuda.probe import cuda_usable

_USABLE, _WHY = cuda_usable()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not _USABLE:
                item.add_marker(pytest.mark.skip(reason=_WHY))
