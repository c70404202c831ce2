"""``pdfleet-runtime router-launch``: sglang-router 0.3.2 with its keys read from mounted files.

sglang-router takes its worker key (``--api-key``) and its control-plane keys only as arguments, which
any process of the pod (and ``ps``) can read from ``/proc/<pid>/cmdline``. This launcher parses the
router's own arguments with the router's own parser, sets both keys on the parsed arguments from the
files, and starts the router in this process (its Python launcher's ``launch_router``), so no key is on
a command line or in the environment. Arguments naming a key are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdfleet_runtime.protocol.keys import SecretError, load_secret

__all__ = ["KEY_FLAGS", "LaunchError", "key_text", "launch", "router_args"]

KEY_FLAGS = ("--api-key", "--control-plane-api-keys", "--router-api-key", "--router-control-plane-api-keys")


class LaunchError(ValueError):
    """The router cannot be launched as asked; the message names the argument or file."""


def key_text(path: Path, what: str) -> str:
    """A key file's text (ASCII: an HTTP header carries it); ``LaunchError`` naming the file otherwise."""
    try:
        raw = load_secret(path)
    except SecretError as e:
        raise LaunchError(f"{what}: {e}") from None
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise LaunchError(f"{what} {path} is not ASCII text (an HTTP header carries it)") from None


def router_args(argv: Sequence[str], *, api_key_file: Path, control_keys_file: Path | None) -> Any:
    """The router's ``RouterArgs`` from ``argv`` (its own flags) and the key files; ``LaunchError`` when
    ``argv`` names a key itself or a file is missing, short or not text."""
    for arg in argv:
        if arg.split("=", 1)[0] in KEY_FLAGS:
            raise LaunchError(f"{arg.split('=', 1)[0]} on the command line: keys come from the mounted files "
                              "(--api-key-file, --control-plane-keys-file), never from arguments")
    from sglang_router.launch_router import parse_router_args
    from sglang_router.router_args import RouterArgs

    args = parse_router_args(list(argv))
    args.api_key = key_text(api_key_file, "the worker key")
    if control_keys_file is not None:
        entries = [ln.strip() for ln in key_text(control_keys_file, "the control-plane keys").splitlines() if ln.strip()]
        try:
            args.control_plane_api_keys = RouterArgs._parse_control_plane_api_keys(entries)
        except (ValueError, IndexError) as e:
            raise LaunchError(f"the control-plane keys in {control_keys_file}: {e} (format id:name:role:key)") from None
    return args


def launch(argv: Sequence[str], *, api_key_file: Path, control_keys_file: Path | None) -> None:
    """Start sglang-router with ``argv`` and the keys from the files, and beside it the sweeper of workers
    whose pods are gone (``stale_workers``); returns when the router stops."""
    args = router_args(argv, api_key_file=api_key_file, control_keys_file=control_keys_file)
    from sglang_router.launch_router import launch_router

    from pdfleet_runtime.front.stale_workers import stop_process, sweeper_from_router_args

    sweeper = sweeper_from_router_args(args)
    pid = sweeper.start_process() if sweeper is not None else None
    try:
        launch_router(args)
    finally:
        if pid is not None:
            stop_process(pid)
