"""``dlserve perf`` flags: ranges, shapes, and bad values (exit 99, perf_analyzer's status
for errors, with a clear message)."""

from __future__ import annotations

import argparse
import sys

import pytest

from dlserve.cli import build_parser, main
from dlserve.perf.cli import settings_from_args
from dlserve.perf.flags import UsageError, parse_range, parse_shape


def parse(*argv: str):
    return build_parser().parse_args(["perf", *argv])


def settings(*argv: str):
    return settings_from_args(parse(*argv))


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``dlserve perf ARGV``; it must exit 99; return what it said."""
    with pytest.raises(SystemExit) as exc:
        main(["perf", *argv])
    assert exc.value.code == 99
    err = capsys.readouterr().err
    assert "dlserve perf: error:" in err, err
    return err


# -- ranges and shapes ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        ("4", int, (4, 4, 1)),
        ("1:8", int, (1, 8, 1)),
        ("1:16:5", int, (1, 16, 5)),
        ("2:0", int, (2, 0, 1)),  # end 0: no limit
        ("100", float, (100.0, 100.0, 1)),
        ("50.5:200:49.5", float, (50.5, 200.0, 49.5)),
    ],
)
def test_ranges(text, kind, expected):
    assert parse_range(text, kind) == expected


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        ("", int, "start[:end[:step]]"),
        ("1:2:3:4", int, "start[:end[:step]]"),
        ("1::2", int, "start[:end[:step]]"),
        ("a:4", int, "not an integer"),
        ("1.5", int, "not an integer"),
        ("0:4", int, "start must be positive"),
        ("-1", int, "start must be positive"),
        ("1:4:0", int, "step must be positive"),
        ("8:4", int, "end must not be below start"),
        ("10:0", float, "end must not be below start"),
        ("x", float, "not a number"),
        ("nan", float, "finite"),
    ],
)
def test_bad_ranges(text, kind, message):
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        parse_range(text, kind)
    assert message in str(exc.value)


def test_shapes():
    assert parse_shape("INPUT0:1,2,3") == ("INPUT0", [1, 2, 3])
    assert parse_shape("ns:name:16") == ("ns:name", [16])  # the name may hold colons
    assert parse_shape("X:0") == ("X", [0])
    for bad, message in (("INPUT0", "NAME:d1"), (":4", "NAME:d1"), ("A:1,b", "not an integer"),
                         ("A:-1", "negative"), ("A:", "not an integer")):
        with pytest.raises(argparse.ArgumentTypeError) as exc:
            parse_shape(bad)
        assert message in str(exc.value)


def test_defaults_follow_perf_analyzer():
    s = settings("-m", "add_sub")
    assert (s.protocol, s.url, s.mode, s.levels, s.batch_size) == ("http", "localhost:8000", "concurrency", [1], 1)
    assert (s.measurement_interval_ms, s.stability_percentage, s.max_trials, s.percentile) == (5000, 10.0, 10, -1)
    assert (s.input_data, s.string_length, s.shared_memory, s.output_shm_size) == ("random", 128, "none", 102400)
    assert settings("-m", "m", "-i", "gRPC").url == "localhost:8001"


def test_sweeps_and_urls():
    assert settings("-m", "m", "--concurrency-range", "1:16:5").levels == [1, 6, 11, 16]
    assert settings("-m", "m", "--concurrency-range", "4").levels == [4]
    rate = settings("-m", "m", "--request-rate-range", "100:300:100", "--request-distribution", "poisson")
    assert (rate.mode, rate.levels, rate.distribution) == ("request_rate", [100.0, 200.0, 300.0], "poisson")
    assert settings("-m", "m", "--request-rate-range", "0.1:0.3:0.1").levels == [0.1, 0.2, 0.3]
    unbounded = settings("-m", "m", "--concurrency-range", "2:0:2", "-l", "10")
    assert unbounded.sweep_unbounded and unbounded.levels == [2] and unbounded.sweep_step == 2
    assert settings("-m", "m", "-u", "http://127.0.0.1:9000/").url == "127.0.0.1:9000"
    shaped = settings("-m", "m", "--shape", "A:1,2", "--shape", "B:3")
    assert shaped.shapes == {"A": [1, 2], "B": [3]}
    periodic = settings("-m", "m", "-i", "grpc", "--streaming", "--periodic-concurrency-range", "1:7:3",
                        "--request-period", "5", "--profile-export-file", "/tmp/no-such-profile.json")
    assert (periodic.periodic_range, periodic.request_period) == ((1, 7, 3), 5)
    assert (periodic.mode, periodic.levels) == ("concurrency", [1])  # (the export's experiment, as perf_analyzer's)
    assert settings("-m", "m", "--periodic-concurrency-range", "2:4", "-i", "grpc", "--streaming",
                    "--profile-export-file", "/tmp/no-such-profile.json").periodic_range == (2, 4, 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency-range", "0:4"], "argument --concurrency-range: start must be positive"),
        (["--concurrency-range", "a"], "argument --concurrency-range: 'a' in 'a' is not an integer"),
        (["--request-rate-range", "5:1"], "argument --request-rate-range: end must not be below start"),
        (["--concurrency-range", "1", "--request-rate-range", "10"], "cannot specify more than one inference load"),
        (["--concurrency-range", "1:0"], "needs --latency-threshold"),
        (["-b", "0"], "argument -b/--batch-size: must be at least 1"),
        (["--shape", "INPUT0"], "argument --shape: expected NAME:d1,d2,..."),
        (["--shape", "A:1", "--shape", "A:2"], "two different shapes for input 'A'"),
        (["--percentile", "100"], "argument --percentile: must be in [1, 99]"),
        (["-r", "2"], "argument -r/--max-trials: must be at least 3"),
        (["-p", "0"], "argument -p/--measurement-interval: must be at least 1"),
        (["-s", "-5"], "must be a positive number"),
        (["-i", "tcp"], "argument -i/--protocol: invalid choice 'tcp'"),
        (["--request-distribution", "uniform"], "invalid choice: 'uniform'"),
        (["--shared-memory", "posix"], "invalid choice: 'posix'"),
        (["--streaming"], "--streaming needs -i grpc"),
        (["-i", "grpc", "--input-tensor-format", "json"], "json are for -i http"),
        (["--output-tensor-format", "text"], "invalid choice: 'text'"),
        (["-i", "inprocess"], "-i inprocess needs --model-repository"),
        (["-i", "inprocess", "--model-repository", ".", "--processes", "2"], "--processes must be 1"),
        (["--model-repository", "."], "--model-repository is for -i inprocess only"),
        (["--input-data", "/no/such/file.json"], "'/no/such/file.json' does not exist"),
        (["-u", "localhost"], "-u: expected HOST:PORT"),
        (["-x", "latest"], "-x: a model version is a non-negative integer, got 'latest'"),
        (["-u", "localhost:99999"], "-u: expected HOST:PORT"),
        (["-f", "/no/such/dir/out.csv"], "-f: folder '/no/such/dir' does not exist"),
        (["-a", "--sync"], "-a/--async and --sync cannot be used together"),
        (["--sequence-id-range", "5:5"], "end must be above start"),
        (["--request-parameter", "k:v"], "expected name:value:type"),
        (["-H", "NoColon"], "expected Header:Value"),
        (["--request-parameter", "sequence_id:1:int"], "sequence_id is set by dlserve perf itself"),
        (["--bls-composing-models", "a:x"], "expected NAME[:VERSION]"),
        (["--request-intervals", "/no/such/intervals"], "--request-intervals: cannot read '/no/such/intervals'"),
        (["--request-intervals", "/dev/null", "--concurrency-range", "2"], "more than one inference load mode"),
        (["--periodic-concurrency-range", "1:3", "--request-rate-range", "10"], "more than one inference load mode"),
        (["--periodic-concurrency-range", "2"], "both <start> and <end> values must be provided, got '2'"),
        (["--periodic-concurrency-range", "1:2:3:4"], "expected start:end[:step], got '1:2:3:4'"),
        (["--periodic-concurrency-range", "2:8:0"], "the <step> value must be > 0"),
        (["--periodic-concurrency-range", "0:6:3"], "the <start> value must be > 0"),
        (["--periodic-concurrency-range", "8:2"], "the <start> must be <= <end>"),
        (["--periodic-concurrency-range", "2:8:4"], "the <step> value must be a factor of the range size"),
        (["--periodic-concurrency-range", "1:3", "-i", "grpc"], "requires bi-directional gRPC streaming"),
        (["--periodic-concurrency-range", "1:3", "-i", "grpc", "--streaming"],
         "must provide --profile-export-file when using the --periodic-concurrency-range option"),
        (["--periodic-concurrency-range", "1:3", "-i", "grpc", "--streaming", "--profile-export-file", "/tmp/no-p.json",
          "-f", "/tmp/p.csv"], "-f cannot be used with --periodic-concurrency-range"),
        (["--periodic-concurrency-range", "1:3", "-i", "grpc", "--streaming", "--profile-export-file", "/tmp/no-p.json",
          "--processes", "2"], "--processes above 1 cannot be used with --periodic-concurrency-range"),
        (["--request-period", "0"], "argument --request-period: must be at least 1"),
        (["--request-intervals", "/dev/null"], "holds no interval above 0"),
        (["--binary-search", "--concurrency-range", "4"], "--binary-search needs a range with an end above"),
        (["--binary-search", "--concurrency-range", "1:0", "-l", "5"], "--binary-search needs a range"),
        (["--grpc-compression-algorithm", "gzip"], "--grpc-compression-algorithm is for -i grpc"),
        (["--ssl-grpc-use-ssl"], "--ssl-grpc-* are for -i grpc"),
        (["-i", "grpc", "--ssl-grpc-root-certifications-file", "/etc/hostname"], "need --ssl-grpc-use-ssl"),
        (["-i", "grpc", "--ssl-grpc-use-ssl", "--ssl-grpc-private-key-file", "/etc/hostname"],
         "mutual TLS needs both"),
        (["-i", "grpc", "--ssl-grpc-use-ssl", "--ssl-grpc-root-certifications-file", "/no/ca.pem"],
         "'/no/ca.pem' does not exist"),
    ],
)
def test_bad_values_exit_2(capsys, argv, message):
    err = usage_error(capsys, "-m", "add_sub", *argv)
    assert message in err, err


def test_model_is_required(capsys):
    err = usage_error(capsys)
    assert "-m/--model-name" in err


def test_input_data_files_are_all_kept(tmp_path):
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    first.write_text("{}")
    second.write_text("{}")
    given = ["--input-data", str(first), "--input-data", str(second)]
    assert settings("-m", "m", *given).input_data == [str(first), str(second)]
    assert settings("-m", "m", "--input-data", "zero", *given[:2]).input_data == [str(first)]
    assert settings("-m", "m", "--input-data", "zero").input_data == "zero"


def test_input_data_directory_is_the_only_input_data(capsys, tmp_path):
    """perf_analyzer's data directory (it was refused); alone, as perf_analyzer refuses it
    with zero or random (and reads it as JSON after a JSON file)."""
    assert settings("-m", "m", "--input-data", str(tmp_path)).input_data == [str(tmp_path)]
    err = usage_error(capsys, "-m", "m", "--input-data", str(tmp_path), "--input-data", "zero")
    assert f"'{tmp_path}' is a directory, which must be the only --input-data" in err


def test_cuda_shared_memory_without_cuda_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    err = usage_error(capsys, "-m", "m", "--shared-memory", "cuda")
    assert "--shared-memory cuda needs CUDA: cupy is not installed" in err


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = usage_error(capsys, "-m", "m", "--plot", str(tmp_path / "p.png"))
    assert "--plot needs matplotlib" in err and "pip install 'dlserve[plot]'" in err


def test_request_intervals_file(tmp_path, capsys):
    path = tmp_path / "intervals.txt"
    path.write_text("100\n\n300.5\n")
    paced = settings("-m", "m", "--request-intervals", str(path))
    assert paced.request_intervals_us == [100.0, 300.5] and paced.mode == "request_rate"
    assert paced.levels == [pytest.approx(1e6 / 200.25)]
    path.write_text("100\nsoon\n")
    assert "line 2 of" in usage_error(capsys, "-m", "m", "--request-intervals", str(path))


def test_usage_error_is_raised_for_combinations():
    with pytest.raises(UsageError):
        settings("-m", "m", "--streaming", "-i", "http")


def test_help_lists_perf(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["perf", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--concurrency-range", "--request-rate-range", "--shared-memory", "--processes",
                 "--percentile", "--warmup-request-count", "--json", "--plot"):
        assert flag in out
