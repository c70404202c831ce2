#!/usr/bin/env bash
# NIXL on the GPU host: see run.sh.
exec "$(dirname "$0")/run.sh" nixl "$@"
