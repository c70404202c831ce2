#!/usr/bin/env bash
# Mooncake on the GPU host: see run.sh.
exec "$(dirname "$0")/run.sh" mooncake "$@"
