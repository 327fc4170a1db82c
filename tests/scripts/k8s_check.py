"""Consistency checks of deploy/k8s that a schema cannot see.

    python3 k8s_check.py MANIFEST.yaml...

kubernetes-validate checks each object against the API's schema; this checks
that the objects fit together and fit rumor: selectors match pod labels,
probes and Services name ports that exist, every volume mount has a volume,
the containers run rumor-launch commands, the bootstrap list names pods that
the bootstrap StatefulSet makes, shards match replicas, peers ask for a GPU,
keys come from the Secrets deploy/k8s/make-secrets.sh writes, and SIGTERM
has time to do its work. Prints one line per problem; exit status 1 if any.
"""
import re
import sys

import yaml

SECRETS = {"rumor-cluster", "rumor-bootstrap-identities", "rumor-peer-identities"}
LAUNCH_COMMANDS = {"keys", "bootstrap", "peer"}

problems = []


def problem(where, what):
    problems.append(f"{where}: {what}")


def pod_spec(obj):
    kind = obj["kind"]
    if kind in ("StatefulSet", "Deployment", "Job"):
        return obj["spec"]["template"]
    return None


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def check_workload(obj, where, services):
    tmpl = pod_spec(obj)
    labels = tmpl["metadata"].get("labels", {})
    spec = tmpl["spec"]
    sel = obj["spec"].get("selector", {}).get("matchLabels")
    if obj["kind"] != "Job":
        if not sel:
            problem(where, "no selector.matchLabels")
        elif any(labels.get(k) != v for k, v in sel.items()):
            problem(where, f"selector {sel} does not match the pod labels {labels}")
    if obj["kind"] == "StatefulSet" and obj["spec"].get("serviceName") not in services:
        problem(where, f"serviceName {obj['spec'].get('serviceName')} is no Service in these files")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claim_names = {c["metadata"]["name"] for c in obj["spec"].get("volumeClaimTemplates", [])}
    used = set()
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        cw = f"{where} container {c['name']}"
        ports = {p.get("name") for p in c.get("ports", [])}
        for m in c.get("volumeMounts", []):
            used.add(m["name"])
            if m["name"] not in volumes and m["name"] not in claim_names:
                problem(cw, f"mounts volume {m['name']}, which is not defined")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            p = c.get(probe)
            if not p:
                continue
            port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
            if isinstance(port, str) and port not in ports:
                problem(cw, f"{probe} uses port {port}, which the container does not name")
        args = c.get("args") or []
        if not args or args[0] not in LAUNCH_COMMANDS:
            problem(cw, f"args {args} do not start with a rumor-launch command {sorted(LAUNCH_COMMANDS)}")
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            problem(cw, "allowPrivilegeEscalation is not false")
    for name in volumes:
        if name not in used:
            problem(where, f"volume {name} is never mounted")
    for v in volumes.values():
        srcs = [s["secret"] for s in v.get("projected", {}).get("sources", []) if "secret" in s]
        if "secret" in v:
            srcs.append(v["secret"])
        for s in srcs:
            name = s.get("name") or s.get("secretName")
            if name not in SECRETS:
                problem(where, f"secret {name} is not one make-secrets.sh writes")
    return labels, spec


def main(paths):
    docs = []
    for path in paths:
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    docs.append((path, d))
    services = {d["metadata"]["name"]: (p, d) for p, d in docs if d["kind"] == "Service"}
    workloads = [(p, d) for p, d in docs if pod_spec(d) is not None]
    pods = {}
    for path, obj in workloads:
        where = f"{path}: {obj['kind']} {obj['metadata']['name']}"
        pods[obj["metadata"]["name"]] = (where, obj) + check_workload(obj, where, services)

    # Services select some workload's pods, by ports those pods name.
    for name, (path, svc) in services.items():
        where = f"{path}: Service {name}"
        sel = svc["spec"].get("selector", {})
        matched = [w for w in pods.values() if all(w[2].get(k) == v for k, v in sel.items())]
        if not matched:
            problem(where, f"selector {sel} matches no pod template")
        if svc["spec"].get("clusterIP") != "None":
            problem(where, "not headless (clusterIP: None): pods must be dialled by their own addresses")
        for port in svc["spec"].get("ports", []):
            tp = port.get("targetPort")
            for w in matched:
                names = {p.get("name") for c in w[3]["containers"] for p in c.get("ports", [])}
                if isinstance(tp, str) and tp not in names:
                    problem(where, f"targetPort {tp} is not a port of {w[0]}")

    boot = pods.get("rumor-bootstrap")
    if not boot:
        problem("files", "no StatefulSet rumor-bootstrap")
        return
    boot_obj = boot[1]
    boot_svc = boot_obj["spec"]["serviceName"]
    boot_replicas = boot_obj["spec"].get("replicas", 1)
    boot_port = {p["name"]: p["containerPort"] for p in boot[3]["containers"][0]["ports"]}["gossip"]
    if boot_obj["kind"] != "StatefulSet":
        problem(boot[0], "bootstrap nodes need stable names: a StatefulSet")

    peer_kinds = 0
    for name, (where, obj, labels, spec) in pods.items():
        if labels.get("app.kubernetes.io/component") != "peer":
            continue
        peer_kinds += 1
        c = spec["containers"][0]
        env = env_of(c)
        gpu = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if gpu is None:
            problem(where, "peers ask for no GPU (resources.limits nvidia.com/gpu)")
        if spec.get("terminationGracePeriodSeconds", 30) < 60:
            problem(where, "terminationGracePeriodSeconds < 60: too short to save a checkpoint on SIGTERM")
        n = obj["spec"].get("replicas", obj["spec"].get("completions"))
        if env.get("RUMOR_SHARDS") != str(n):
            problem(where, f"RUMOR_SHARDS={env.get('RUMOR_SHARDS')} but {n} peers")
        if obj["kind"] == "Job" and obj["spec"].get("completionMode") != "Indexed":
            problem(where, "a Job of peers must be Indexed (JOB_COMPLETION_INDEX gives the shard)")
        for addr in (env.get("RUMOR_BOOTSTRAP") or "").split(","):
            m = re.fullmatch(r"rumor-bootstrap-(\d+)\.([a-z0-9-]+):(\d+)", addr)
            if not m:
                problem(where, f"bootstrap address {addr!r} is not POD.SERVICE:PORT of the bootstrap StatefulSet")
            elif int(m.group(1)) >= boot_replicas or m.group(2) != boot_svc or int(m.group(3)) != boot_port:
                problem(where, f"bootstrap address {addr} names no pod and port of StatefulSet rumor-bootstrap")
        if "POD_IP" not in env:
            problem(where, "no POD_IP: the peer would not know which address to advertise")
        wait = re.search(r"--wait-peers (\d+)", env.get("RUMOR_OPTS") or "")
        if wait and int(wait.group(1)) > n:
            problem(where, f"--wait-peers {wait.group(1)} but only {n} peers")
    if peer_kinds == 0:
        problem("files", "no peers")

    # Discovery: the names a bootstrap node resolves are these Services.
    denv = env_of(boot[3]["containers"][0])
    for entry in (denv.get("RUMOR_DISCOVER") or "").split(","):
        svc = entry.split(":")[0]
        if svc not in services:
            problem(boot[0], f"RUMOR_DISCOVER names {svc}, which is no Service in these files")


if __name__ == "__main__":
    main(sys.argv[1:])
    for p in problems:
        print(p)
    print(f"k8s_check: {len(problems)} problem(s) in {len(sys.argv) - 1} file(s)")
    sys.exit(1 if problems else 0)
