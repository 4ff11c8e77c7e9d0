import json

from kernels import bench_kernels


def test_bench_script_runs_on_tiny_shapes(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench_kernels.main(["--tiny", "--sweep", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    names = {row["name"] for row in rows}
    assert names == {
        "store_kvcache",
        "decode",
        "decode-tile",
        "decode-best",
        "prefill",
        "prefill-best",
        "rms_norm",
        "rms_norm+add",
        "rotary",
        "silu_and_mul",
        "sample",
        "argmax_lse",
    }
    assert all(row["kernel_ms"] > 0 for row in rows)
    assert "skipped" not in capsys.readouterr().out


def test_bench_script_times_a_float8_cache(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench_kernels.main(["--tiny", "--only", "store,decode,prefill", "--kv-cache-dtype", "fp8",
                               "--json", str(out)]) == 0
    assert {row["name"] for row in json.loads(out.read_text())} == {"store_kvcache", "decode", "prefill"}
    assert "kv cache fp8" in capsys.readouterr().out
