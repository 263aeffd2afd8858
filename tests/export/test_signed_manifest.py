"""Export manifests signed by the fleet kit's CA: a device started with --trust-ca (or whose bundle says
signed_programs) loads a program only if its manifest carries that CA's signature.

The device side runs in a subprocess whose exit status is asserted: a good signature accepted, a manifest edited after
signing refused, a signature by another CA refused, an unsigned program refused when signatures are required and
accepted when they are not; every refusal one line naming the file, never a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from mqtt_support import mosquitto_url  # noqa: F401 - a pytest fixture

from coordinator.kit.accounts import FleetSpec
from coordinator.kit.pki import make_ca
from coordinator.kit.writer import generate_fleet_kit
from fedge.algorithms.catalog import make_objective
from fedge.errors import ConfigError
from fedge.programs.spec import ModelSpec, TrainingLoss, program_file_name
from fedge_cli.main import main
from fedge_io import manifest, signing
from fedge_io.credentials import load_bundle
from tests.export.test_manifest import client_files, run_device_side

FEDGE = [sys.executable, "-m", "fedge_cli.main"]
SPEC = ModelSpec("tiny_mlp", (1, 8, 8), 10)
PROGRAM = program_file_name(SPEC, TrainingLoss(make_objective("ce", {})), 64)
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fleet kit (TLS: it has a CA) whose device bundles require signed programs."""
    root = tmp_path_factory.mktemp("kit") / "kit"
    spec = FleetSpec("r", ["c000"], ["127.0.0.1"], 1 << 20, signed_programs=True)
    generate_fleet_kit(spec, root, issued_at=NOW)
    return root


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another fleet's CA (ca.key, ca.crt): its signatures must not pass for the kit's."""
    folder = tmp_path_factory.mktemp("other-ca")
    ca = make_ca("other", NOW, days=30)
    (folder / "ca.key").write_bytes(ca.key_pem)
    (folder / "ca.crt").write_bytes(ca.cert_pem)
    return folder


@pytest.fixture(scope="module")
def signed(kit: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CE training program and the .onnx, exported and signed with the kit's CA (`--sign-key KIT`)."""
    out = tmp_path_factory.mktemp("signed") / "programs"
    args = ["export", "--model", "tiny_mlp", "--input-shape", "1,8,8", "--format", "onnx", "pte-train"]
    args += ["--objective", "ce", "--max-batch", "64", "--out", str(out), "--sign-key", str(kit)]
    assert main(args) == 0
    return out


def copy_of(directory: Path, to: Path) -> Path:
    shutil.copytree(directory, to)
    return to


def test_the_signature_covers_the_manifest_it_was_made_for_and_every_key_type_signs(tmp_path: Path) -> None:
    ca = make_ca("t", NOW, days=30)
    manifest.write_file(tmp_path, "a.bin", b"program", "pte")
    manifest.sign(tmp_path, ca.key)
    assert manifest.verified_read(tmp_path / "a.bin", trust=ca.cert) == b"program"
    manifest.write_file(tmp_path, "b.bin", b"another", "pte")  # the manifest changed: its old signature is gone
    assert not (tmp_path / manifest.SIGNATURE_FILE).exists()
    with pytest.raises(manifest.ManifestError, match=r"manifest\.json is not signed"):
        manifest.verified_read(tmp_path / "a.bin", trust=ca.cert)
    assert manifest.verified_read(tmp_path / "a.bin") == b"program"  # the digests still hold without a trust anchor

    for key in (rsa.generate_private_key(65537, 2048), ed25519.Ed25519PrivateKey.generate()):
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        path = tmp_path / f"{type(key).__name__}.pem"
        path.write_bytes(pem)
        loaded = signing.load_signing_key(path)
        assert signing.signed_by_key(loaded.public_key(), b"data", signing.sign(loaded, b"data"))
        assert not signing.signed_by_key(loaded.public_key(), b"date", signing.sign(loaded, b"data"))


def test_a_bad_key_or_certificate_is_one_line_naming_the_file_never_its_content(tmp_path: Path) -> None:
    secret = "-----BEGIN PRIVATE KEY-----\nTk9UQUtFWQ==\n-----END PRIVATE KEY-----\n"
    (tmp_path / "bad.key").write_text(secret)
    with pytest.raises(ConfigError, match=r"bad\.key is not a PEM private key") as info:
        signing.load_signing_key(tmp_path / "bad.key")
    assert "Tk9UQUtFWQ" not in str(info.value)
    with pytest.raises(ConfigError, match=r"is a directory without ca\.key"):
        signing.load_signing_key(tmp_path)
    with pytest.raises(ConfigError, match=r"bad\.key is not a PEM X\.509 certificate"):
        signing.load_trusted_ca(tmp_path / "bad.key")
    (tmp_path / "sig").mkdir()
    manifest.write_file(tmp_path / "sig", "a.bin", b"x", "pte")
    (tmp_path / "sig" / manifest.SIGNATURE_FILE).write_bytes(b"\0" * (signing.MAX_SIGNATURE_BYTES + 1))
    with pytest.raises(manifest.ManifestError, match=r"manifest\.json\.sig is larger than"):
        manifest.verified_read(tmp_path / "sig" / "a.bin", trust=make_ca("t", NOW, days=1).cert)


def test_fedge_export_check_accepts_the_kits_signature_only(
    signed: Path, kit: Path, other_ca: Path, tmp_path: Path
) -> None:
    trust = ["--trust-ca", str(kit / "clients" / "c000")]  # a device bundle's directory: its ca.crt
    good = run_device_side(["export", "check", str(signed / "tiny_mlp.onnx"), *trust], tmp_path)
    assert good.returncode == 0, (good.stdout[-2000:], good.stderr[-2000:])

    # Edited after signing: a program swapped for another and its digest updated (what an attacker with write access
    # to the directory can do); the signature no longer matches the manifest.
    edited = copy_of(signed, tmp_path / "edited")
    doc = json.loads((edited / manifest.MANIFEST_FILE).read_text())
    data = b"not the program that was signed"
    (edited / "tiny_mlp.onnx").write_bytes(data)
    doc["files"]["tiny_mlp.onnx"].update(sha256=manifest.sha256_bytes(data), bytes=len(data))
    (edited / manifest.MANIFEST_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    # Signed by another CA: the other fleet's CA key over the same manifest.
    foreign = copy_of(signed, tmp_path / "foreign")
    assert main(["export", "sign", str(foreign), "--sign-key", str(other_ca / "ca.key")]) == 0
    unsigned = copy_of(signed, tmp_path / "unsigned")
    (unsigned / manifest.SIGNATURE_FILE).unlink()

    done = run_device_side(
        ["export", "check", *(str(d / "tiny_mlp.onnx") for d in (edited, foreign, unsigned)), *trust], tmp_path
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, (done.stdout[-2000:], done.stderr[-2000:])
    failed = [line for line in done.stdout.splitlines() if "FAILED" in line]
    assert len(failed) == 3, done.stdout
    assert f"{edited}/tiny_mlp.onnx: FAILED: {edited}/manifest.json: the signature" in failed[0]
    assert f"{foreign}/tiny_mlp.onnx: FAILED: {foreign}/manifest.json: the signature" in failed[1]
    assert "CN=fedge fleet CA of run r" in failed[1]
    assert f"{unsigned}/manifest.json is not signed" in failed[2]
    # Without --trust-ca the unsigned copy passes (its digests hold); the edited one too: its digests were updated.
    assert run_device_side(["export", "check", str(unsigned / "tiny_mlp.onnx")], tmp_path).returncode == 0


def serve_until_connected(args: list[str], cwd: Path, timeout: float = 240.0) -> tuple[int, str]:
    """Start a client in its own process; once it has loaded its programs and connected, stop it as its service
    manager would (SIGTERM). Its exit status (0: it served) and its log; one refused at start-up exits by itself."""
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    proc = subprocess.Popen([*FEDGE, *args], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stderr:  # ends when the process exits
            lines.append(line)
            if " connected to " in line:
                proc.send_signal(signal.SIGTERM)
            if time.monotonic() > deadline:
                break
        return proc.wait(timeout=30), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_device_that_requires_signatures_loads_only_programs_its_ca_signed(
    signed: Path,
    kit: Path,
    other_ca: Path,
    tmp_path: Path,
    mosquitto_url: str,  # noqa: F811
) -> None:
    config, data = client_files(tmp_path)
    base = ["client", "--client-id", "c000", "--data", str(data), "--run-config", str(config), "--run", "r"]
    base += ["--broker", mosquitto_url, "--runtime", "executorch"]
    trust = ["--trust-ca", str(kit / "ca" / "ca.crt")]

    def client(programs: Path, *extra: str) -> tuple[int, str]:
        code, log = serve_until_connected([*base, "--program-cache", str(programs), *extra], tmp_path)
        assert "Traceback" not in log and code not in (-6, -11, 134, 139), log[-2000:]
        return code, log

    code, log = client(signed, *trust)  # the kit's signature: loaded, then served until stopped
    assert code == 0 and "prepared 1 training program(s)" in log, log[-2000:]

    # Signed by another CA (edited and unsigned copies: the export check's test above, and the predict-only client
    # below; each client start costs seconds).
    foreign = copy_of(signed, tmp_path / "foreign")
    manifest.sign(foreign, signing.load_signing_key(other_ca))
    unsigned = copy_of(signed, tmp_path / "unsigned")
    (unsigned / manifest.SIGNATURE_FILE).unlink()
    code, log = client(foreign, *trust)
    assert code == 2, log[-2000:]
    errors = [line for line in log.splitlines() if line.startswith("fedge: ")]
    assert len(errors) == 1 and f"{foreign}/manifest.json" in errors[0] and "the signature" in errors[0], log[-2000:]
    assert " connected to " not in log  # refused at start-up, before any connection

    # Signatures not required: the unsigned program is loaded (the workstation client does not export it again).
    code, log = client(unsigned)
    assert code == 0 and "prepared 1 training program(s)" in log and "exporting" not in log, log[-2000:]

    # A predict-only ONNX Runtime client's --model-file: the same rule.
    # (No --run-config: a predict-only client given a training run's config stops at once, exit 3: it cannot train.)
    onnx = [a for a in base[:-2] if a not in ("--run-config", str(config))]
    onnx += ["--runtime", "onnxruntime", "--predict-only", *trust]
    code, log = serve_until_connected([*onnx, "--model-file", str(signed / "tiny_mlp.onnx")], tmp_path)
    assert code == 0 and "Traceback" not in log, log[-2000:]
    code, log = serve_until_connected([*onnx, "--model-file", str(unsigned / "tiny_mlp.onnx")], tmp_path)
    assert code == 2 and f"{unsigned}/manifest.json is not signed" in log and "Traceback" not in log, log[-2000:]


def test_the_kit_says_whether_devices_require_signed_programs(kit: Path, tmp_path: Path) -> None:
    bundle = load_bundle(kit / "clients" / "c000")
    assert bundle.program_ca == str((kit / "clients" / "c000" / "ca.crt").resolve())
    # `fedge provision --signed-programs` writes it into every device's bundle (not the coordinator's).
    argv = ["provision", "--out", str(tmp_path / "p"), "--dataset", "synthetic", "--model", "tiny_mlp"]
    argv += ["--num-clients", "2", "--fleet-broker", "127.0.0.1", "--fleet-broker-dir", str(tmp_path / "p" / "b")]
    assert main([*argv, "--signed-programs"]) == 0
    made = tmp_path / "p" / "kit"
    assert all(json.loads((d / "bundle.json").read_text())["signed_programs"] for d in (made / "clients").iterdir())
    assert "signed_programs" not in json.loads((made / "coordinator" / "bundle.json").read_text())
    assert main([*argv[:2], str(tmp_path / "q"), *argv[3:], "--signed-programs", "--no-tls"]) == 2
    plain = tmp_path / "plain"
    generate_fleet_kit(FleetSpec("r", ["c000"], ["127.0.0.1"], 1 << 20), plain, issued_at=NOW)
    raw = json.loads((plain / "clients" / "c000" / "bundle.json").read_text())
    assert raw["signed_programs"] is False and load_bundle(plain / "clients" / "c000").program_ca is None
    with pytest.raises(ConfigError, match="signed programs need the kit's CA"):
        FleetSpec("r", ["c000"], ["127.0.0.1"], 1 << 20, tls=False, signed_programs=True)


def test_an_onnxruntime_training_artifact_directory_needs_the_cas_signature_too(
    kit: Path, other_ca: Path, tmp_path: Path
) -> None:
    """``ArtifactDirectory(trust=...)`` (``fedge client --runtime onnxruntime-training --trust-ca``) checks the set's
    manifest before any file reaches ONNX Runtime, so placeholder bytes stand in for the artifacts here."""
    from edge_client.backends.ort_training import ARTIFACT_FILES, ArtifactDirectory, artifact_dir_name

    loss = TrainingLoss(make_objective("ce", {}))
    ca = signing.load_trusted_ca(kit / "ca" / "ca.crt")
    sets = {}
    for name, key in (("kit", kit), ("foreign", other_ca / "ca.key"), ("unsigned", None)):
        directory = tmp_path / name / artifact_dir_name(SPEC, loss)
        for file in ARTIFACT_FILES:
            manifest.write_file(directory, file, f"{file} of the {name} set".encode(), "ort-training")
        if key is not None:
            manifest.sign(directory, signing.load_signing_key(key))
        sets[name] = directory
    assert ArtifactDirectory(tmp_path / "kit", trust=ca)(SPEC, loss) == sets["kit"]
    assert ArtifactDirectory(tmp_path / "unsigned")(SPEC, loss) == sets["unsigned"]  # signatures not required
    for name, reason in (("foreign", "the signature"), ("unsigned", "is not signed")):
        with pytest.raises(ConfigError, match=f"{sets[name]}/manifest.json") as refused:
            ArtifactDirectory(tmp_path / name, trust=ca)(SPEC, loss)
        assert reason in str(refused.value)
    # An artifact changed after signing: its digest no longer matches, named with its file.
    (sets["kit"] / ARTIFACT_FILES[1]).write_bytes(b"swapped")
    with pytest.raises(ConfigError, match=f"{ARTIFACT_FILES[1]}: SHA-256 does not match"):
        ArtifactDirectory(tmp_path / "kit", trust=ca)(SPEC, loss)
