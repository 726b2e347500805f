#!/usr/bin/env bash
# Queue a heal on Slurm: an array of N shard workers over the per-layer units, then the publishing job.
#   deploy/slurm/submit.sh path/to/heal.toml [N]      N defaults to the number of units not yet in the lake
# Extra sbatch options (partition, account, time) go in SBATCH_* variables or the scripts' headers.
set -euo pipefail
config=$(realpath "$1")
here=$(dirname "$(realpath "$0")")
moeheal=${MOEHEAL:-moeheal}
todo=$("$moeheal" plan -c "$config" --units --format json |
       python3 -c 'import json, sys; print(sum(u["status"] == "compute" for u in json.load(sys.stdin)))')
n=${2:-$todo}
if [ "$n" -lt 1 ]; then n=1; fi
array=$(MOEHEAL_CONFIG="$config" sbatch --parsable --export=ALL --array=0-$((n - 1)) "$here/heal_units.sbatch")
MOEHEAL_CONFIG="$config" sbatch --parsable --export=ALL --dependency=afterok:"${array%%;*}" "$here/publish.sbatch"
echo "units: array job $array ($n tasks for $todo units to compute); publish after it"
