"""`python -m bench.kernels --tiny` on the CPU (Triton's interpreter): the rows it writes."""

import json

import pytest

from bench import kernels as bench_kernels

# What each case moves (GB/s rows) or computes (TFLOP/s rows), counted by hand for the TINY
# shapes (4 query heads, 2 KV heads, head_dim 64, hidden 256, intermediate 128, vocab 2000,
# 8 tokens) in bf16 (2 bytes; the fp8 cache: 1 byte per K/V element).
KV_TOKEN_ELEMENTS = 2 * 64  # one token's K (or V): 2 heads x 64
EXPECTED = {
    # K and V of 8 tokens, read in bf16 and written to the cache
    ("store_kvcache", "T=8"): ("GB/s", 2 * 8 * KV_TOKEN_ELEMENTS * (2 + 2)),
    # the same, and q (8 x 4 x 64) read and written (rotated in place)
    ("rope_store", "T=8"): ("GB/s", 2 * 8 * KV_TOKEN_ELEMENTS * (2 + 2) + 2 * 8 * 4 * 64 * 2),
    # K and V of 2 sequences x 40 cached tokens, read once
    ("decode", "B=2 ctx=40 bs=16"): ("GB/s", 2 * 2 * 40 * KV_TOKEN_ELEMENTS * 2),
    # 2 sequences x 16 new queries: each sees 8 cached keys and a causal 1..16; QK^T and PV at
    # 2 FLOPs per multiply-add, 4 heads x 64
    ("prefill", "B=2 new=16 cached=8 bs=16"): ("TFLOP/s", 4 * 2 * (16 * 8 + (16 * 17) // 2) * 4 * 64),
    # 8 x 256 bf16 read and written; with the residual, both read and both written
    ("rms_norm", "T=8 H=256"): ("GB/s", 2 * 8 * 256 * 2),
    ("rms_norm+add", "T=8 H=256"): ("GB/s", 4 * 8 * 256 * 2),
    # q (8 x 4 x 64) and k (8 x 2 x 64) read and written
    ("rotary", "T=8 Hq=4 Hkv=2"): ("GB/s", 2 * 8 * (4 + 2) * 64 * 2),
    # gate and up (8 x 2 x 128) read, half that written
    ("silu_and_mul", "T=8 I=128"): ("GB/s", (8 * 256 + 8 * 128) * 2),
    # fp32 logits of 2 rows x 2000, read once
    ("sample", "B=2 V=2000"): ("GB/s", 2 * 2000 * 4),
    ("argmax_lse", "B=2 V=2000"): ("GB/s", 2 * 2000 * 4),
}
FP8_EXPECTED = {
    ("store_kvcache", "T=8"): ("GB/s", 2 * 8 * KV_TOKEN_ELEMENTS * (2 + 1)),
    ("rope_store", "T=8"): ("GB/s", 2 * 8 * KV_TOKEN_ELEMENTS * (2 + 1) + 2 * 8 * 4 * 64 * 2),
    ("decode", "B=2 ctx=40 bs=16"): ("GB/s", 2 * 2 * 40 * KV_TOKEN_ELEMENTS * 1),
    ("prefill", "B=2 new=16 cached=8 bs=16"): EXPECTED[("prefill", "B=2 new=16 cached=8 bs=16")],
}


@pytest.fixture(autouse=True)
def _single_thread():
    import torch

    # NOTE: the interpreter's tensors are tiny: extra intra-op threads only spin on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def work_of(row: dict) -> float:
    """Bytes or FLOPs of a row, from the rate and time the bench reports."""
    scale = 1e9 if row["unit"] == "GB/s" else 1e12
    return row["rate"] * scale * row["kernel_ms"] * 1e-3


def check_rows(rows: list[dict], expected: dict) -> None:
    timed = {(r["name"], r["case"]): r for r in rows if r["name"] in {name for name, _ in expected}}
    assert set(timed) == set(expected)
    for key, (unit, work) in expected.items():
        row = timed[key]
        assert row["unit"] == unit, key
        assert work_of(row) == pytest.approx(work, rel=1e-9), key
        assert row["kernel_ms"] > 0 and row["ref_ms"] is not None and row["ref_ms"] > 0, key


def test_bench_script_reports_what_each_kernel_moves_at_the_tiny_shapes(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench_kernels.main(["--tiny", "--sweep", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {row["name"] for row in rows} == {name for name, _ in EXPECTED} | {"decode-tile", "decode-best",
                                                                              "prefill-best"}
    assert set(rows[0]) == {"name", "case", "kernel_ms", "ref_ms", "rate", "unit", "sdpa_ms", "note", "timing"}
    assert {row["timing"] for row in rows} == {"eager"}  # on the CPU; a GPU times kernels in CUDA graphs
    check_rows(rows, EXPECTED)
    # the sweep: every tile configuration of the decode case timed, the best one is their fastest
    tiles = [r for r in rows if r["name"] == "decode-tile"]
    (best,) = [r for r in rows if r["name"] == "decode-best"]
    assert len(tiles) == len(bench_kernels.DECODE_TILES) * 3 and best["case"] == "B=2 ctx=40 bs=16"
    assert best["kernel_ms"] == min(r["kernel_ms"] for r in tiles)
    assert best["note"] in {r["note"] for r in tiles if r["kernel_ms"] == best["kernel_ms"]}
    (prefill_best,) = [r for r in rows if r["name"] == "prefill-best"]
    assert work_of(prefill_best) == pytest.approx(EXPECTED[("prefill", prefill_best["case"])][1], rel=1e-9)
    assert "skipped" not in capsys.readouterr().out


def test_bench_script_times_a_float8_cache(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench_kernels.main(["--tiny", "--only", "store,decode,prefill", "--kv-cache-dtype", "fp8",
                               "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {row["name"] for row in rows} == {"store_kvcache", "rope_store", "decode", "prefill"}
    check_rows(rows, FP8_EXPECTED)  # the cache's bytes at one per element
    assert "kv cache fp8" in capsys.readouterr().out


def test_decode_cases_picks_the_decode_shapes_run(tmp_path):
    out = tmp_path / "rows.json"
    assert bench_kernels.main(["--tiny", "--only", "decode", "--decode-cases", "2x40", "--json", str(out)]) == 0
    assert [row["case"] for row in json.loads(out.read_text())] == ["B=2 ctx=40 bs=16"]
    assert bench_kernels.main(["--tiny", "--only", "decode", "--decode-cases", "384x640", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == []  # the tiny shapes have no such case
