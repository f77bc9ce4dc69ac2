"""Every knob refuses what it cannot use at start-up, naming the variable."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest

from memra_obs.environment import ConfigError, Settings, parse_addr


@pytest.fixture
def pem(tmp_path):
    """A self-signed certificate and its key (openssl), and a file that is not PEM."""
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    return str(cert), str(key), str(junk)


@pytest.mark.parametrize(
    ("var", "value", "why"),
    [
        ("MEMRA_OBS_METRICS_ADDR", "nowhere.invalid:9464", "cannot resolve"),
        ("MEMRA_OBS_METRICS_ADDR", "192.0.2.1:9464", "not an address of this host"),
        ("MEMRA_OBS_METRICS_ADDR", "127.0.0.1:٩٤٦٤", "expected host:port"),
        ("MEMRA_OBS_METRICS_ADDR", "http://127.0.0.1:9464", "expected host:port .no scheme"),
        ("MEMRA_OBS_WORKER", "", "must not be empty"),
        ("MEMRA_OBS_SPANS_FILE", "   ", "must not be empty"),
        ("MEMRA_OBS_QUEUE_SIZE", "1_024", "digits 0-9 only"),
        ("MEMRA_OBS_QUEUE_SIZE", "١٠٢٤", "digits 0-9 only"),
        ("MEMRA_OBS_ROUND_SPANS", "+5", "digits 0-9 only"),
        ("MEMRA_OBS_REQUESTS_DETAIL", "true", "expected an integer 0..1 "),  # its range said
        ("MEMRA_OBS_SPANS_FILE_MAX_BYTES", "64MiB", "bytes 1048576..1125899906842624 .*digits 0-9"),
        ("MEMRA_OBS_RING_SLOTS", "64k", "a power of two 64..16777216 .* .digits 0-9 only"),
        ("MEMRA_OBS_ADVICE_WINDOW", "2k", "expected 0 .no advice gauges. or 32.*digits 0-9 only"),
        ("MEMRA_OBS_MAX_DEVICES", "0", "expected 1..4096"),
        ("MEMRA_OBS_PLAIN_STEP_MS", "6_8", "positive number of milliseconds"),
        ("MEMRA_OBS_PLAIN_STEP_MS", "1e3", "positive number of milliseconds"),
        ("MEMRA_OBS_PLAIN_STEP_MS", "2000000", "below 1e6"),  # positive, but past the cap
        ("MEMRA_OBS_SINKS", "all,bogus", "unknown sink 'bogus'"),
        # fewer rounds than advise() needs: the advisor's gauges would never appear
        ("MEMRA_OBS_ADVICE_WINDOW", "20", "expected 0 .* or 32"),
    ],
)
def test_a_bad_value_names_its_variable(var, value, why):
    """Each refusal says which variable and why."""
    with pytest.raises(ConfigError, match=why) as e:
        Settings.resolve({var: value})
    assert var in str(e.value)


@pytest.mark.parametrize("env", [{"MEMRA_OBS_WORKER": " w1\n"}, {"RANK": " w1 "}])
def test_the_worker_label_is_trimmed(env):
    """A padded value from a YAML or .env file made a second ``worker=" w1"`` series (RANK and
    MEMRA_OBS_WORKER alike), which dashboards and joins on ``worker`` missed."""
    assert Settings.resolve(env).worker == "w1"
    assert Settings.resolve({}, worker=" w1 ").worker == "w1"


def test_a_bracketed_ipv6_metrics_address_binds_the_host_inside_the_brackets():
    """``[::1]:9464`` is IPv6 loopback, port 9464 (the brackets are not part of the host)."""
    assert parse_addr("MEMRA_OBS_METRICS_ADDR", " [::1]:9464 ", check=False) == ("::1", 9464)


def test_env_replaces_os_environ_for_the_default_worker(monkeypatch):
    """The default worker label is the given env's RANK (else the pid), never os.environ's."""
    monkeypatch.setenv("RANK", "9")
    assert Settings.resolve({"RANK": "3"}).worker == "3"
    assert Settings.resolve({}).worker == str(os.getpid())
    assert Settings.resolve().worker == "9"


@pytest.mark.parametrize(
    ("name", "value"), [("queue_size", True), ("sinks", ["otel"]), ("metrics_addr", ("h", 1))]
)
def test_an_argument_of_the_wrong_type_is_refused_naming_it(name, value):
    """An argument is a str or a number (a bool only for requests_detail), never stored as given."""
    with pytest.raises(ConfigError, match=f"argument {name}="):
        Settings.resolve({}, **{name: value})
    st = Settings.resolve({}, requests_detail=True, plain_step_ms=2.5, queue_size=64)
    assert (st.requests_detail, st.plain_step_ms, st.queue_size) == (True, 2.5, 64)
    assert Settings.resolve({}, requests_detail=False).requests_detail is False


def test_tls_files_must_be_a_pem_chain_and_its_key(pem):
    """A certificate or key that is not PEM (or not a pair) fails at start-up."""
    cert, key, junk = pem
    assert (
        Settings.resolve(
            {"MEMRA_OBS_METRICS_TLS_CERT": cert, "MEMRA_OBS_METRICS_TLS_KEY": key}
        ).metrics_tls_cert
        == cert
    )
    for c, k in ((junk, key), (cert, junk), (key, cert)):
        with pytest.raises(ConfigError, match="not a PEM certificate chain") as e:
            Settings.resolve({"MEMRA_OBS_METRICS_TLS_CERT": c, "MEMRA_OBS_METRICS_TLS_KEY": k})
        assert "MEMRA_OBS_METRICS_TLS_CERT" in str(e.value)


def test_an_encrypted_metrics_key_is_refused_never_prompted_for(pem, tmp_path):
    """On a terminal, an encrypted MEMRA_OBS_METRICS_TLS_KEY stopped every command at OpenSSL's
    "Enter PEM pass phrase:" (the check at start-up, then the server's own load)."""
    import fcntl
    import select
    import termios

    cert, key, _ = pem
    locked = tmp_path / "locked.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-out", str(locked), "-aes256", "-passout",
                    "pass:secret"], check=True, capture_output=True, timeout=60)  # fmt: skip
    code = ("from memra_obs.environment import Settings as S\n"
            f"S.resolve({{'MEMRA_OBS_METRICS_TLS_CERT': {cert!r}, "
            f"'MEMRA_OBS_METRICS_TLS_KEY': {str(locked)!r}}})")  # fmt: skip
    master, slave = os.openpty()
    p = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave,
                         start_new_session=True,  # the pty its controlling terminal: /dev/tty
                         preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # fmt: skip
    os.close(slave)
    out = b""
    while select.select([master], [], [], 20)[0]:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        out += chunk
        if not chunk or b"pass phrase" in out:
            break
    p.kill()
    p.wait(10)
    os.close(master)
    assert b"pass phrase" not in out and b"its unencrypted private key" in out, out


def test_otlp_client_pair_must_be_a_pem_certificate_and_its_key(pem, tmp_path):
    """mTLS for OTLP: a pair that does not load is a ConfigError naming both variables (it was
    a raw ssl.SSLError when HTTPS started); an encrypted key is refused, never prompted for."""
    from memra_obs.otel.config import OtlpConfig

    cert, key, junk = pem
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://x"}
    ok = OtlpConfig.from_env({**env, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": cert,
                              "OTEL_EXPORTER_OTLP_CLIENT_KEY": key})  # fmt: skip
    assert (ok.client_certificate, ok.client_key) == (cert, key)
    locked = tmp_path / "locked.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-out", str(locked), "-aes256", "-passout",
                    "pass:secret"], check=True, capture_output=True, timeout=60)  # fmt: skip
    for c, k in ((junk, key), (cert, junk), (key, cert), (cert, str(locked))):
        pair = {
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": c,
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": k,
        }
        with pytest.raises(
            ConfigError, match="not a readable PEM certificate and its unencrypted"
        ) as e:
            OtlpConfig.from_env({**env, **pair})
        assert (
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE / OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"
            in str(e.value)
        )


def test_a_small_float_argument_is_taken_as_its_decimal():
    """``plain_step_ms=1e-05`` is a positive number of milliseconds, whatever str() prints."""
    for v in (1e-5, 1e-9, 2.5):
        assert Settings.resolve({}, plain_step_ms=v).plain_step_ms == v
    with pytest.raises(ConfigError, match="argument plain_step_ms="):
        Settings.resolve({}, plain_step_ms=float("nan"))


def test_basic_auth_needs_a_user_and_a_password(tmp_path):
    """``user:`` (empty password) and ``:pw`` are refused; ``user:pw`` is taken."""
    f = tmp_path / "auth"
    for bad in ("user:\n", ":pw\n", "nocolon\n"):
        f.write_text(bad)
        with pytest.raises(ConfigError, match="MEMRA_OBS_METRICS_BASIC_AUTH_FILE"):
            Settings.resolve({"MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(f)})
    for good in (b"user:pw\n", b"\xef\xbb\xbfuser:pw\r\n"):  # a BOM was part of the user: 401s
        f.write_bytes(good)
        auth = Settings.resolve({"MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(f)}).metrics_basic_auth
        assert auth == ("user", "pw")


def test_a_basic_auth_file_that_is_not_utf8_is_refused_without_its_bytes(tmp_path):
    """A Latin-1 password file was refused quoting the codec's error: a byte of the password
    and its position, on stderr and in the pod's log."""
    (f := tmp_path / "auth").write_bytes(b"prom:p\xe4ssw\xf6rd\n")
    with pytest.raises(ConfigError, match=r"BASIC_AUTH_FILE=.*: not UTF-8 text") as e:
        Settings.resolve({"MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(f)})
    assert not re.search(r"0xe4|\\xe4|position", str(e.value)), e.value


def test_blank_paths_are_unset_and_padded_ones_trimmed():
    """``MEMRA_OBS_AGENT=' '`` made a ring in ``/dev/shm/ /`` and ``MEMRA_OBS_REQUESTS_FILE=' '``
    a file named ``' '``: blank is unset (as empty is), and a path is trimmed, as the TLS ones."""
    for var, name in (("MEMRA_OBS_AGENT", "agent"), ("MEMRA_OBS_REQUESTS_FILE", "requests_file")):
        assert getattr(Settings.resolve({var: " "}), name) is None
        assert getattr(Settings.resolve({var: " /x/y "}), name) == "/x/y"


def test_the_cli_exits_2_with_one_line_on_a_bad_knob():
    """``memra-obs demo`` with a bad knob: exit status 2 and the variable named."""
    p = subprocess.run(
        [sys.executable, "-m", "memra_obs.cli", "demo", "--requests", "1"],
        env={"PATH": "/usr/bin:/bin", "MEMRA_OBS_QUEUE_SIZE": "1_024"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "MEMRA_OBS_QUEUE_SIZE" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("raw", "knob", "otel"),
    [
        ("2.5", 2.5, 2.5),
        (" .5 ", 0.5, 0.5),
        ("1e-3", None, 0.001),
        ("-0.25", None, -0.25),
        ("+4", None, 4.0),
        ("1_000", None, None),
        ("\u0661\u0662", None, None),
        ("nan", None, None),
        ("inf", None, None),
        ("", None, None),
    ],
)
def test_one_number_grammar_for_knobs_and_otel_variables(raw, knob, otel):
    """A knob takes digits and one point; an OTEL_* number (a sampler ratio, a timeout) also a
    sign and an exponent, as the SDKs read it; neither takes float()'s nan, inf, 1_000 or
    other scripts' digits."""
    from memra_obs.environment import decimal

    assert decimal(raw) == knob
    assert decimal(raw, otel=True) == otel


def test_a_tls_pair_an_argument_set_is_refused_naming_the_arguments(pem):
    """``configure(metrics_tls_cert=...)`` alone, or with a key that is not its pair, was refused
    naming MEMRA_OBS_METRICS_TLS_CERT / _KEY, set or not (set to a good file: the message quoted
    the argument's value under the variable's name)."""
    cert, key, junk = pem
    with pytest.raises(ConfigError) as e:
        Settings.resolve({}, metrics_tls_cert=cert)
    assert str(e.value).startswith("argument metrics_tls_cert and argument metrics_tls_key go")
    with pytest.raises(ConfigError, match="not a PEM") as e:
        Settings.resolve({"MEMRA_OBS_METRICS_TLS_CERT": cert}, metrics_tls_cert=junk,
                         metrics_tls_key=key)  # fmt: skip
    assert f"argument metrics_tls_cert={junk!r} / argument metrics_tls_key=" in str(e.value)
    assert "MEMRA_OBS_METRICS_TLS_CERT" not in str(e.value)
    with pytest.raises(
        ConfigError, match=r"^MEMRA_OBS_METRICS_TLS_CERT and MEMRA_OBS_METRICS_TLS_"
    ):
        Settings.resolve({"MEMRA_OBS_METRICS_TLS_CERT": cert})  # the variables' refusal stays


def test_an_otlp_timeout_past_a_million_seconds_is_no_limit():
    """``OTEL_EXPORTER_OTLP_TIMEOUT=2147483647``, the specification's own "very long time" that
    ``0`` stands for, was refused as "expected a number of milliseconds >= 0"."""
    from memra_obs.otel.config import NO_LIMIT_S, OtlpConfig

    for ms in ("2147483647", "3e9", "1e12"):
        assert OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": ms}).timeout_s == NO_LIMIT_S
    assert OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "999999999"}).timeout_s < NO_LIMIT_S
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT='-5'"):
        OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "-5"})


def test_a_padded_spans_file_is_trimmed_as_the_other_paths():
    """``MEMRA_OBS_SPANS_FILE='s.jsonl '`` wrote a file named with the space (the requests file,
    the ring directory and the TLS files were trimmed)."""
    assert Settings.resolve({"MEMRA_OBS_SPANS_FILE": " /x/s.jsonl "}).spans_file == "/x/s.jsonl"


def test_a_number_of_thousands_of_digits_is_refused_not_a_traceback():
    """int() raises ValueError past 4,300 digits: a command printed a traceback, not one line."""
    import argparse

    from memra_obs.environment import positive

    huge = "1" * 5000
    for var, value in (("MEMRA_OBS_QUEUE_SIZE", huge), ("MEMRA_OBS_METRICS_ADDR", f"h:{huge}")):
        with pytest.raises(ConfigError, match=f"^{var}=.*(expected 16|out of range)"):
            Settings.resolve({var: value})
    with pytest.raises(argparse.ArgumentTypeError, match="not a positive integer"):
        positive(int)(huge)
    assert Settings.resolve({"MEMRA_OBS_QUEUE_SIZE": "00064"}).queue_size == 64


def test_a_misspelled_knob_is_said_once_with_the_knob_it_is_near(caplog, tmp_path):
    """``MEMRA_OBS_SINK=prometheus`` (no S) published nothing and said nothing: a no-op
    observer. A name of the prefix no knob reads is said once, with its near knob; the
    compose file's and the scripts' own names are not knobs and are not said."""
    from memra_obs.wiring import build_exporters, build_observer

    env = {"MEMRA_OBS_SINK": "prometheus", "MEMRA_OBS_ROUNDSPANS": "8", "MEMRA_OBS_X": "1",
           "MEMRA_OBS_SPANS_DIR": "/data", "MEMRA_OBS_REQUIRE_PEERS": "1", "MEMRA_OBS_REQUIRE_ORACLE": "1"}  # fmt: skip
    with caplog.at_level("WARNING", logger="memra_obs"):
        build_observer(env=env)
        build_exporters(Settings.resolve(env), env=env)  # the agent's and the tail's way in
    said = [r.getMessage() for r in caplog.records if "not a memra_obs knob" in r.getMessage()]
    assert said == [
        "MEMRA_OBS_ROUNDSPANS is not a memra_obs knob (did you mean MEMRA_OBS_ROUND_SPANS?); "
        "ignored",
        "MEMRA_OBS_SINK is not a memra_obs knob (did you mean MEMRA_OBS_SINKS?); ignored",
        "MEMRA_OBS_X is not a memra_obs knob (the knobs: README, Knobs); ignored",
    ]


def test_a_knob_whose_sink_is_off_is_said_once(caplog, tmp_path):
    """``MEMRA_OBS_METRICS_ADDR=:9464`` alone (no ``prometheus`` in ``MEMRA_OBS_SINKS``)
    published nothing and said nothing. Each knob only an off sink reads is said once, naming
    the sink; one the argument set or an empty one (off) is not. In agent mode the knobs only
    the agent reads are said as such (a worker's ``MEMRA_OBS_ADVICE_WINDOW`` changed nothing,
    unsaid); what the worker still reads (``MEMRA_OBS_PLAIN_STEP_MS``: its advice line) is not."""
    from memra_obs import diagnostics
    from memra_obs.wiring import build_observer

    diagnostics.reset()
    env = {"MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0", "MEMRA_OBS_SPANS_FILE": "s.jsonl",
           "MEMRA_OBS_SINKS": "otel", "MEMRA_OBS_ROUND_SPANS": "8"}  # fmt: skip
    with caplog.at_level("WARNING", logger="memra_obs"):
        off = {**env, "MEMRA_OBS_METRICS_ADDR": ""}  # empty: /metrics off, nothing to say
        build_observer(env=off, spans_file=str(tmp_path / "s.jsonl")).shutdown()
        for _ in range(2):
            build_observer(env=env, spans_file=str(tmp_path / "s.jsonl")).shutdown()
        agent = {"MEMRA_OBS_AGENT": str(tmp_path), "MEMRA_OBS_ADVICE_WINDOW": "64",
                 "MEMRA_OBS_PLAIN_STEP_MS": "20", "MEMRA_OBS_SINKS": "prometheus"}  # fmt: skip
        build_observer(env={**env, **agent}, metrics_addr="").shutdown()
    said = [r.getMessage() for r in caplog.records if "it does nothing" in r.getMessage()]
    agent_mode = "in agent mode (MEMRA_OBS_AGENT) the agent publishes: it does nothing here"
    assert said == [
        "MEMRA_OBS_METRICS_ADDR is set, but MEMRA_OBS_SINKS (otel) has no prometheus: it does "
        "nothing (add prometheus there)",
        *(f"{var} is set, but {agent_mode} (set it on memra-obs agent)" for var in (
            "MEMRA_OBS_SPANS_FILE", "MEMRA_OBS_ROUND_SPANS", "MEMRA_OBS_ADVICE_WINDOW")),
    ]  # fmt: skip


def test_an_otlp_timeout_in_seconds_for_opentelemetry_python_is_said(caplog):
    """The application's own opentelemetry-python exporter, in the same process, reads
    ``OTEL_EXPORTER_OTLP_TIMEOUT=10`` as 10 s; memra_obs, as the specification, as 10 ms: every
    span was dropped ("timed out") with no word of why. It is taken as written, and said once."""
    from memra_obs import diagnostics
    from memra_obs.otel.config import OtlpConfig

    diagnostics.reset()
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        for ms in ("10", "10", "2500", "0"):
            OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": ms})
        assert OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "10"}).timeout_s == 0.01
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "OTEL_EXPORTER_OTLP_TIMEOUT='10': 10 ms, the specification's unit (opentelemetry-python "
        "reads it as seconds: 10000 here for 10 s)",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT='10': 10 ms, the specification's unit "
        "(opentelemetry-python reads it as seconds: 10000 here for 10 s)",
    ]


def test_a_worker_label_past_its_bound_is_refused_and_one_within_it_fits_the_ring():
    """A 3,000-character ``MEMRA_OBS_WORKER`` (or ``configure(worker=...)``) made each session
    record too large for the agent's ring: refused, unsaid, and no spec.session span. Now a
    start-up ConfigError naming it, its length and the bound; a label at the bound fits the
    largest session record (family and tags at their caps, every character 4 bytes)."""
    from memra_obs.agent import format as F
    from memra_obs.environment import MAX_WORKER
    from memra_obs.timeline import SessionRecord

    for env, arg, name in (({"MEMRA_OBS_WORKER": "w" * 3000}, None, "MEMRA_OBS_WORKER"),
                           ({}, "w" * 3000, "argument worker")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"3000 bytes long .* at most {MAX_WORKER}") as e:
            Settings.resolve(env, worker=arg)
        assert str(e.value).startswith(name)
    label = Settings.resolve({"MEMRA_OBS_WORKER": "é" * (MAX_WORKER // 2)}).worker
    big = "\U0001f600"
    rec = SessionRecord(1, big * 56, big * 64, big * 64, label, 1, 2, 3, 1 << 127, 1, 1, 2,
                        True, "event", 1 << 127)  # fmt: skip
    assert len(F.encode(rec, True)[1]) <= F.MAXSPAN * F.PAYLOAD
