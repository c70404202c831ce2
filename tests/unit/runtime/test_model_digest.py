"""``spec.model.source.digest`` (issue 47): a model directory's content, checked by the built-in runtime.

The digest changes with any file's bytes, name, addition or removal and with nothing else (order of creation,
timestamps); a symlinked file counts by its content; a mismatch is refused before loading, naming both digests
and the command that prints the right one; admission keeps the field to the built-in runtime's path sources.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdfleet_operator.api.constants import Role
from pdfleet_operator.api.models import PDDeploymentSpec
from pdfleet_operator.cli import main
from pdfleet_operator.resources.compat import compat_key
from pdfleet_operator.resources.runtime_config import runtime_config
from pdfleet_operator.validation import validate_object
from pdfleet_runtime.model.config_values import ModelConfigError
from pdfleet_runtime.model.digest import check_digest, directory_digest


def _model(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x00" * 1000, "sub/tokenizer.json": b"{}"}


def test_the_digest_is_the_content(tmp_path: Path) -> None:
    a = directory_digest(_model(tmp_path / "a", FILES))
    b = directory_digest(_model(tmp_path / "b", dict(reversed(FILES.items()))))
    assert a == b and a.startswith("sha256:") and len(a) == 71
    os.utime(tmp_path / "b" / "config.json", (0, 0))
    assert directory_digest(tmp_path / "b") == a
    for change in ({"model.safetensors": b"\x00" * 999 + b"\x01"}, {"extra.txt": b""}):
        assert directory_digest(_model(tmp_path / f"c{len(change)}{next(iter(change))}", {**FILES, **change})) != a
    (tmp_path / "b" / "sub" / "tokenizer.json").rename(tmp_path / "b" / "sub" / "tok.json")
    assert directory_digest(tmp_path / "b") != a


def test_a_symlinked_blob_counts_by_content(tmp_path: Path) -> None:
    direct = directory_digest(_model(tmp_path / "direct", FILES))
    linked = _model(tmp_path / "snap", {k: v for k, v in FILES.items() if k != "model.safetensors"})
    blob = _model(tmp_path / "blobs", {"abc": FILES["model.safetensors"]}) / "abc"
    (linked / "model.safetensors").symlink_to(blob)
    assert directory_digest(linked) == direct


def test_a_mismatch_is_refused_with_both_digests(tmp_path: Path) -> None:
    root = _model(tmp_path / "m", FILES)
    good = directory_digest(root)
    check_digest(root, good)
    check_digest(root, None)
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ModelConfigError, match=f"has digest {good}.*is {wrong}.*pdfleet digest") as e:
        check_digest(root, wrong)
    assert e.value.field == "digest"
    with pytest.raises(ModelConfigError, match="not a directory"):
        directory_digest(tmp_path / "missing")


def test_the_cli_prints_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _model(tmp_path / "m", FILES)
    assert main(["digest", str(root)]) == 0
    assert capsys.readouterr().out.strip() == directory_digest(root)
    assert main(["digest", str(tmp_path / "none")]) == 2


def _builtin(digest: str | None) -> dict:
    src: dict = {"path": "/models/zen", "volume": {"hostPath": {"path": "/models/zen"}}}
    if digest is not None:
        src["digest"] = digest
    return {"apiVersion": "pdfleet.io/v1alpha1", "kind": "PDDeployment", "metadata": {"name": "zen"},
            "spec": {"model": {"layout": {"preset": "llama-dense"}, "source": src},
                     "transfer": {"backend": "mooncake", "protocol": "tcp"},
                     "prefill": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "r:1"},
                     "decode": {"replicas": 1, "parallelism": {"tensor": 1}, "image": "r:1"}}}


def test_the_built_in_runtime_gets_it_and_pairs_by_it() -> None:
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    specs = {}
    for d in (a, b, None):
        v = validate_object(_builtin(d))
        assert v.admitted, v.violations
        specs[d] = PDDeploymentSpec.model_validate(v.spec)
    assert runtime_config("zen", "ns", specs[a], Role.DECODE).model is not None
    assert runtime_config("zen", "ns", specs[a], Role.DECODE).model.digest == a  # type: ignore[union-attr]
    assert len({compat_key(specs[d], Role.DECODE) for d in (a, b, None)}) == 3
    bad = validate_object(_builtin("sha1:" + "a" * 40))
    assert not bad.admitted
