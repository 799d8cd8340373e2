import os
import tempfile

import pytest

# Every test session gets its own kernel cache, so runs never depend on ~/.cache state.
os.environ.setdefault("TILECRAFT_CACHE_DIR", tempfile.mkdtemp(prefix="tilecraft-test-cache-"))
# nvcc's output for a source, kept for this session (both xdist workers: they share the directory above).
# Several tests build the same generated source (a kernel one test checks in SASS and another in its ptxas log),
# and each nvcc run is 3-10 s of CI, most of it parsing TileLang's headers. Fixed here, at session start: a test
# that points TILECRAFT_CACHE_DIR elsewhere (fresh_cache) still shares the builds.
_CUBINS = os.path.join(os.environ["TILECRAFT_CACHE_DIR"], "test-cubins")


def pytest_configure(config):
    from backends.cuda import sass

    build = sass.compile_cubin
    if getattr(build, "memo", False):
        return

    def compile_cubin(source, arch, flags=None):
        """sass.compile_cubin, once per (nvcc, source, arch, flags) a session: the same bytes and log."""
        import hashlib

        from backends.cuda.toolchain import find_toolchain

        # the nvcc path in the key: a test that points TILECRAFT_NVCC at another compiler builds anew
        # (a missing toolchain raises here, as the real call would; failures are never kept)
        key = hashlib.sha256(repr((str(find_toolchain().nvcc), source, arch, flags)).encode()).hexdigest()
        path = os.path.join(_CUBINS, key)
        try:
            with open(path + ".cubin", "rb") as f:
                cubin = f.read()
            with open(path + ".log") as f:
                return cubin, f.read()
        except OSError:
            pass
        cubin, log = build(source, arch, flags)
        os.makedirs(_CUBINS, exist_ok=True)
        for ext, data, mode in ((".log", log, "w"), (".cubin", cubin, "wb")):   # the cubin last: it marks the pair
            tmp = f"{path}{ext}.{os.getpid()}"
            with open(tmp, mode) as f:
                f.write(data)
            os.replace(tmp, path + ext)
        return cubin, log

    compile_cubin.memo = True
    sass.compile_cubin = compile_cubin


def _gpu_missing_reason():
    import torch

    if torch.version.cuda is None:
        return f"no CUDA GPU: torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_missing_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def off_alignment():
    """off_alignment(t, nbytes) -> a contiguous view with t's values (and device) that starts nbytes past
    a 16-byte boundary, as a slice of a larger buffer at an odd storage offset would."""
    import torch

    def view(t, nbytes):
        size = t.numel() * t.element_size()
        buf = torch.empty(size + 32, dtype=torch.uint8, device=t.device)
        start = (-buf.data_ptr()) % 16 + nbytes
        out = buf[start:start + size].view(t.dtype).view(t.shape).copy_(t)
        assert out.data_ptr() % 16 == nbytes
        return out
    return view


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty disk cache and an empty in-memory cache for one test."""
    from codegen import jit

    monkeypatch.setenv("TILECRAFT_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memory()
    jit.STATS.clear()
    yield tmp_path / "cache"
    jit.clear_memory()


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(name, seed, fp8=False, **config) -> (checkpoint dir, the dir transformers loads:
    a dequantized copy for FP8 checkpoints). Each name is written once per test session."""
    from model.make_tiny import dequantize_checkpoint, make_tiny

    made = {}

    def get(name, seed, fp8=False, **config):
        if name not in made:
            d = make_tiny(tmp_path_factory.mktemp(name), fp8=fp8, seed=seed, **config)
            made[name] = (d, dequantize_checkpoint(d, tmp_path_factory.mktemp(name + "-deq")) if fp8 else d)
        return made[name]

    return get
