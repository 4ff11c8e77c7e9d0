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
