"""GPU tests: marked ``gpu``; skipped only when there is no CUDA driver or no device.

Any other failure of the probe (a broken driver, a bad context) fails the tests.
"""

import pytest

from cellcache.cuda.driver import device_usable

_USABLE = device_usable()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not _USABLE:
                item.add_marker(pytest.mark.skip(reason="no CUDA driver or no CUDA device"))
