#!/bin/sh
# Sabotage mode: the deny tests of the run-time confinement (sandbox, kernel-call filter, audit
# hooks) with all of it switched off in this, the trusted, process (PRISM_SABOTAGE=1). Every one
# must FAIL; one that passes proves nothing. Exit 0 when none passed. The fork, memory and task
# bombs are left out: unconfined, they are real. What the unconfined attacks wrote on the host
# (the tests' own file names) is removed afterwards. Usage: sh tests/sabotage.sh [pytest args]
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
SELECT="stops or stop_attacks or no_parent_env or shares_the_host_network or opening_a_socket or reading_data \
or outside_the_allow_list or writing_outside or identity_and_namespaces or no_network or filesystem_view \
or only_the_allow_list or hidden_path or feeder_socket or tmp_dir_is_bound or gpu_device_nodes \
or strict_fails_closed or denied_call_fails_inside or another_abi or every_strict_prefix or every_probe_is_held_here"
LOG=$(mktemp)
PRISM_SABOTAGE=1 "$PY" -m pytest -q -rA --tb=no -p no:cacheprovider tests/no_way_out tests/runtime_hostile \
  tests/test_isolation.py tests/test_jail.py tests/test_seccomp.py tests/test_selftest.py -k "$SELECT" "$@" >"$LOG" 2>&1
rm -f /evil.txt /etc/evil.txt /usr/evil.txt /etc/prism-evil.txt /tmp/scratch.txt /dev/shm/scratch evil.txt src/evil.txt \
  /var/tmp/prism-planted-* /var/tmp/prism-e2e-evil-*.txt
failed=$(grep -c '^FAILED' "$LOG")
passed=$(grep '^PASSED' "$LOG")
echo "sabotage mode: $failed deny tests failed, $(printf '%s' "$passed" | grep -c .) passed"
[ -n "$passed" ] && printf 'these prove nothing:\n%s\n' "$passed"
rm -f "$LOG"
[ -z "$passed" ] && [ "$failed" -gt 0 ]
