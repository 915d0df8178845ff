"""bench/gpu_lines.py's reading of which statements run only on a GPU (docs/gpu.md gives the
share of them the tests run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_lines", REPO / "bench" / "gpu_lines.py")
gpu_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_lines)

SOURCE = '''\
def run(device, gpus):
    """torch.cuda.synchronize() in a docstring is not a call."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(2)
    name = torch.cuda.get_device_name(0) if gpus else None
    count = torch.cuda.device_count()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        x = 1
    if device.type != "cuda":
        return name, count
    torch.cuda.synchronize(device)
    return None
'''


def test_gpu_only_statements_are_the_gpu_sides_of_device_branches_and_calls_into_torch_cuda() -> None:
    found = sorted(gpu_lines.gpu_only_statements(SOURCE))
    # the body of `== "cuda"`; after a `!= "cuda"` that returns, the rest of the block; a
    # refusal where there is no GPU, a guarded call and device_count run on a CPU too
    assert found == [(8, 8), (9, 9), (12, 12), (13, 13)]


def test_the_package_has_gpu_only_statements_and_every_one_is_a_real_line() -> None:
    statements = {p: gpu_lines.gpu_only_statements(p.read_text()) for p in (REPO / "fsdp_exp").rglob("*.py")}
    assert sum(len(s) for s in statements.values()) > 40
    distributed = statements[REPO / "fsdp_exp" / "distributed.py"]
    source = (REPO / "fsdp_exp" / "distributed.py").read_text().splitlines()
    assert any("torch.cuda.set_device" in source[first - 1] for first, _ in distributed)
