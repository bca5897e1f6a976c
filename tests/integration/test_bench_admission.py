"""``kvgate bench admission`` runs end to end: tables, report, plot and its doc section."""

from __future__ import annotations

from cli.main import main


def test_bench_admission_prints_the_tables_and_writes_report_plot_and_doc_section(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nthe fleet report\n")
    out = tmp_path / "admission"
    args = ["bench", "admission", "--seconds", "5", "--loads", "2", "--out", str(out),
            "--doc", str(doc)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert (
        "Goodput under overload" in printed and "Priorities under a low-priority flood" in printed
    )
    report = (out / "report.md").read_text()
    assert f"`kvgate bench admission --seconds 5 --loads 2 --out {out} --doc {doc}`" in report
    assert report.count("| kv-aware, no admission | 2x |") == 1
    assert (out / "admission.png").stat().st_size > 10_000
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nthe fleet report\n")
    assert "## Admission control under overload" in text and "](admission/admission.png)" in text
