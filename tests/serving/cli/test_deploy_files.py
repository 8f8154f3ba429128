"""The example deployment files (Dockerfile, configs/deploy/k8s/) against the code, without docker
or a cluster: the manifests parse and list each other consistently, and every `xlaserve`
subcommand and flag they run exists in the CLI (``xlaserve <subcommand> --help``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from serving.cli import main as cli
from tests.support.paths import REPO_ROOT as ROOT

K8S = ROOT / "configs" / "deploy" / "k8s"
DOCKERFILE = ROOT / "Dockerfile"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
"""What the LeaderWorkerSet controller adds to each container's env (before the container's own)."""


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def containers(node, template: str = "template"):
    """(container, the key of its pod template) for every container of every pod template under
    ``node`` ("template"; a LeaderWorkerSet's "leaderTemplate" and "workerTemplate")."""
    if isinstance(node, dict):
        for c in node.get("containers") or ():
            yield c, template
        for key, value in node.items():
            if key != "containers":
                yield from containers(value, key if key.lower().endswith("template") else template)
    elif isinstance(node, list):
        for item in node:
            yield from containers(item, template)


def dockerfile_instruction(name: str) -> list[str]:
    """The JSON (exec) form argument of the Dockerfile's last ``name`` instruction."""
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith(name + " ")]
    assert lines, f"Dockerfile has no {name}"
    return json.loads(lines[-1][len(name) + 1:])


def xlaserve_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `xlaserve`) of the Dockerfile's default command and of every container
    of ours (an image named xlaserve) in the manifests."""
    out = []
    assert dockerfile_instruction("ENTRYPOINT") == ["xlaserve"]
    out.append(("Dockerfile CMD", dockerfile_instruction("CMD")))
    for path in MANIFESTS:
        for doc in documents(path):
            for c, template in containers(doc.get("spec")):
                if "xlaserve" not in c["image"].split("/")[-1].split(":")[0]:
                    continue
                argv = list(c.get("command") or ["xlaserve"]) + [str(a) for a in c.get("args") or ()]
                assert Path(argv[0]).name == "xlaserve", f"{path.name}: {c['name']} runs {argv[0]!r}"
                out.append((f"{path.name} {doc['metadata']['name']}/{template}/{c['name']}", argv[1:]))
    return out


COMMANDS = xlaserve_commands() if DOCKERFILE.exists() and MANIFESTS else []


def test_the_deploy_files_exist():
    assert DOCKERFILE.is_file() and (ROOT / ".dockerignore").is_file()
    assert {p.name for p in MANIFESTS} >= {"gateway.yaml", "engine.yaml", "engine-tpu-multihost.yaml",
                                           "redis.yaml"}
    assert len(COMMANDS) >= 5, COMMANDS  # CMD, gateway, engine, LWS leader and worker


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")) + [DOCKERFILE], ids=lambda p: p.name)
def test_every_file_says_it_is_an_untested_example(path):
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lower())
    text = " ".join(header)
    assert header and "example" in text and "untested" in text and "change" in text, path.name


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_manifests_parse_and_name_themselves(path):
    docs = documents(path)
    assert docs, f"{path.name} holds no document"
    for doc in docs:
        assert isinstance(doc, dict), path.name
        assert doc.get("apiVersion") and doc.get("kind"), (path.name, doc)
        assert (doc.get("metadata") or {}).get("name"), (path.name, doc.get("kind"))


def test_kustomization_lists_exactly_the_manifests():
    (kust,) = documents(K8S / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    resources = kust["resources"]
    assert len(resources) == len(set(resources)), resources
    assert set(resources) == {p.name for p in MANIFESTS}


def _help(subcommand: str, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.main([subcommand, "--help"])
    out = capsys.readouterr()
    assert exit_.value.code == 0, f"`xlaserve {subcommand}` is not a subcommand: {out.err.strip().splitlines()[-1:]}"
    return out.out


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_commands_use_only_existing_subcommands_and_flags(where, argv, capsys):
    subcommand, flags = argv[0], sorted({a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")})
    assert flags, (where, argv)
    text = _help(subcommand, capsys)
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{where}: `xlaserve {subcommand}` has no {', '.join(missing)}"


def test_env_references_are_defined():
    """Every $(VAR) in a container's args or env values names a variable the container defines
    earlier (Kubernetes expands only those) or one LWS injects."""
    for path in MANIFESTS:
        for doc in documents(path):
            injected = LWS_ENV if doc["kind"] == "LeaderWorkerSet" else set()
            for c, _ in containers(doc.get("spec")):
                defined = set(injected)
                for e in c.get("env") or ():
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(e.get("value", ""))):
                        assert ref in defined, f"{path.name} {c['name']}: {e['name']} uses $({ref})"
                    defined.add(e["name"])
                for arg in c.get("args") or ():
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(arg)):
                        assert ref in defined, f"{path.name} {c['name']}: args use $({ref})"


def test_multihost_env_is_what_xlaserve_reads():
    """The LWS manifest's JAX_* variables are the ones sharding/multihost.py resolves, on every pod."""
    source = (ROOT / "sharding" / "multihost.py").read_text()
    (lws,) = [d for d in documents(K8S / "engine-tpu-multihost.yaml") if d["kind"] == "LeaderWorkerSet"]
    pods = [c for c, _ in containers(lws["spec"])]
    assert len(pods) == 2  # leader and worker templates
    for c in pods:
        env = {e["name"]: e.get("value") for e in c["env"]}
        for name, lws_var in (("JAX_COORDINATOR_ADDRESS", "LWS_LEADER_ADDRESS"),
                              ("JAX_NUM_PROCESSES", "LWS_GROUP_SIZE"), ("JAX_PROCESS_ID", "LWS_WORKER_INDEX")):
            assert f'"{name}"' in source, f"sharding/multihost.py no longer reads {name}"
            assert f"$({lws_var})" in env[name], (c["name"], name, env[name])
        assert re.fullmatch(r"\$\(LWS_LEADER_ADDRESS\):\d+", env["JAX_COORDINATOR_ADDRESS"])


def _services() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for p in MANIFESTS for d in documents(p) if d["kind"] == "Service"}


def test_gateway_targets_exist():
    """--engines names pods of the engine StatefulSet (under its headless Service, on its gRPC
    port, within its replica count), --redis-url the Redis Service's port."""
    services = _services()
    sets = {d["metadata"]["name"]: d for p in MANIFESTS for d in documents(p) if d["kind"] == "StatefulSet"}
    (gateway,) = [argv for where, argv in COMMANDS if where.startswith("gateway.yaml")]
    engines = gateway[gateway.index("--engines") + 1].split(",")
    assert len(engines) >= 2
    for url in engines:
        m = re.fullmatch(r"grpcs://([a-z0-9-]+)-(\d+)\.([a-z0-9-]+):(\d+)", url)
        assert m, url
        name, ordinal, service, port = m[1], int(m[2]), m[3], int(m[4])
        sts = sets[name]
        assert sts["spec"]["serviceName"] == service and ordinal < sts["spec"]["replicas"], url
        assert services[service]["spec"].get("clusterIP") == "None", f"{service} is not headless"
        assert port in [p["port"] for p in services[service]["spec"]["ports"]], url
        engine_argv = [str(a) for a in sts["spec"]["template"]["spec"]["containers"][0]["args"]]
        assert engine_argv[engine_argv.index("--grpc-port") + 1] == str(port), url
    m = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", gateway[gateway.index("--redis-url") + 1])
    assert m and int(m[2]) in [p["port"] for p in services[m[1]]["spec"]["ports"]]


def test_dockerfile_copies_what_exists_and_runs_as_a_user():
    text = DOCKERFILE.read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"XLASERVE_DATA_DIR=/data\b", text) and 'VOLUME ["/data"]' in text
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".xlaserve-test-data"} <= ignored
    assert not {"README.md", "pyproject.toml", "CMakeLists.txt", "serving", "kernels_cpu", "configs"} & ignored


PORT_FLAGS = ("--grpc-tls-cert", "--grpc-tls-key", "--grpc-client-ca", "--grpc-token-file")
GATEWAY_FLAGS = ("--grpc-ca-file", "--grpc-client-cert", "--grpc-client-key", "--grpc-token-file")


def _mounted_files(container: dict, volumes: dict[str, dict]) -> dict[str, str]:
    """{mount path: the Secret mounted there} of a container's Secret volumes."""
    return {m["mountPath"]: volumes[m["name"]]["secret"]["secretName"]
            for m in container.get("volumeMounts") or () if "secret" in volumes.get(m["name"], {})}


def _pod_specs(node):
    if isinstance(node, dict):
        if "containers" in node:
            yield node
        for value in node.values():
            yield from _pod_specs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _pod_specs(item)


def test_engine_ports_are_secured_and_their_files_mounted():
    """Every engine in the manifests serves TLS with a client CA and a token, the gateway calls
    them over grpcs:// with its certificate and the token, and each file a flag names lies in a
    mounted Secret (docs/operator/replicas.md#securing-the-engine-port)."""
    seen = set()
    for path in MANIFESTS:
        for doc in documents(path):
            for pod in _pod_specs(doc.get("spec")):
                volumes = {v["name"]: v for v in pod.get("volumes") or ()}
                for c in pod["containers"]:
                    args = [str(a) for a in c.get("args") or ()]
                    if not args or args[0] not in ("engine", "serve"):
                        continue
                    flags = PORT_FLAGS if args[0] == "engine" else GATEWAY_FLAGS
                    mounts = _mounted_files(c, volumes)
                    for flag in flags:
                        assert flag in args, f"{path.name} {c['name']}: no {flag}"
                        file = args[args.index(flag) + 1]
                        assert any(file.startswith(m.rstrip("/") + "/") for m in mounts), \
                            f"{path.name} {c['name']}: {flag} {file} is in no mounted Secret"
                    if args[0] == "serve":
                        assert all(u.startswith("grpcs://") for u in args[args.index("--engines") + 1].split(","))
                    seen.add(args[0])
    assert seen == {"engine", "serve"}
