"""Checks of deploy/: the Helm chart rendered by Helm's own engine and validated against
Kubernetes' schemas, and the systemd units verified by systemd.

Runs offline in a few seconds: python3 -m pytest tests/deploy
"""

import base64
import re
import shutil
import string
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "kubernetes" / "sandbar"
EXAMPLE_VALUES = ROOT / "deploy" / "kubernetes" / "values-example.yaml"
SYSTEMD = ROOT / "deploy" / "systemd"
SERVER_SOURCES = [
    ROOT / "crates" / "sandbar" / "src" / name
    for name in ("main.rs", "cluster.rs", "database.rs", "https.rs")
]
# The oldest Kubernetes the chart is documented for, and the newest the schemas bundle.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
DATABASE_URL = "postgres://sandbar:pw@postgres.db.svc:5432/sandbar"
MINIMAL = {"database": {"url": DATABASE_URL}}


def example_values():
    return yaml.safe_load(EXAMPLE_VALUES.read_text())


def render(values, name="sandbar"):
    """The chart's documents, as `helm install` would send them (NOTES.txt aside)."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name=name, namespace="sandbar", is_install=True)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return docs


def notes(values):
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="sandbar", namespace="sandbar", is_install=True)
    return files["sandbar/templates/NOTES.txt"]


def only(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_spec(docs, kind):
    return only(docs, kind)["spec"]["template"]["spec"]


def container(spec, name):
    return next(c for c in spec["containers"] if c["name"] == name)


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def flag_value(args, flag):
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def server_options():
    """The `sandbar serve` flags and SANDBAR_* variables the binary defines, from its source."""
    flags, envs = set(), set()
    for source in SERVER_SOURCES:
        text = source.read_text()
        envs.update(re.findall(r'env\s*=\s*"(SANDBAR_[A-Z0-9_]+)"', text))
        envs.update(re.findall(r'std::env::var\("(SANDBAR_[A-Z0-9_]+)"\)', text))
        # Each `#[arg(long ...)]` up to the field it describes.
        for attr, field in re.findall(r"#\[arg\(([^\]]*?)\)\]\s*(?:pub\s+)?(\w+)\s*:", text, re.S):
            if not re.search(r"\blong\b", attr):
                continue
            named = re.search(r'long\s*=\s*"([a-z0-9-]+)"', attr)
            flags.add("--" + (named.group(1) if named else field.replace("_", "-")))
    return flags, envs


# ---------------------------------------------------------------------------------------
# The chart


def test_the_chart_lints_clean():
    report = helm.lint(str(CHART), MINIMAL, strict=True, namespace="sandbar")
    assert report["errors"] == []
    # Info-level findings (an icon is recommended) are fine; warnings and errors are not.
    assert [m for m in report["messages"] if m["severity"] > 1] == []


def test_default_values_alone_name_the_missing_database():
    with pytest.raises(Exception, match="database.url"):
        render({})


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", ["minimal", "example"])
def test_every_document_is_valid_kubernetes(case, version):
    values = MINIMAL if case == "minimal" else example_values()
    docs = render(values)
    kinds = sorted(d["kind"] for d in docs)
    expected = ["DaemonSet", "Deployment", "PodDisruptionBudget", "Service"]
    if case == "minimal":
        expected += ["Secret", "Secret", "ServiceAccount", "ServiceAccount"]
    else:
        # Existing Secrets are only named; the API's ServiceAccount is an existing one too.
        expected += ["ServiceAccount"]
    assert kinds == sorted(expected)
    for doc in docs:
        # Strict: a misspelt or misplaced field is an error, not something ignored.
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_api_deployment():
    spec = pod_spec(render(MINIMAL), "Deployment")
    deployment = only(render(MINIMAL), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    api = container(spec, "api")
    assert api["args"][:3] == ["serve", "--role", "api"]
    env = env_of(api)
    assert env["SANDBAR_LISTEN"]["value"] == "0.0.0.0:3000"
    for probe in ("readinessProbe", "livenessProbe"):
        assert api[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # No privilege: a non-root user, a read-only root, no capabilities, no fsGroup (which
    # would open the secret file to a group, and sandbar refuses such a file).
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "fsGroup" not in spec["securityContext"]
    for c in spec["containers"] + spec["initContainers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
    # The data directory is a directory inside a writable emptyDir, so sandbar owns it.
    data_dir = env["SANDBAR_DATA_DIR"]["value"]
    mounts = {m["mountPath"]: m["name"] for m in api["volumeMounts"]}
    assert data_dir.startswith("/var/lib/sandbar/") and mounts["/var/lib/sandbar"] == "data"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes["data"]
    service = only(render(MINIMAL), "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_the_node_daemonset():
    values = example_values()
    spec = pod_spec(render(values), "DaemonSet")
    node = container(spec, "node")
    args = node["args"]
    assert args[:3] == ["serve", "--role", "node"]
    env = env_of(node)
    # --node-id is the Kubernetes node's name, --advertise-url its host IP.
    assert flag_value(args, "--node-id") == "$(NODE_NAME)"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert flag_value(args, "--advertise-url") == "http://$(NODE_IP):3000"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert flag_value(args, "--listen") == "0.0.0.0:3000"
    assert args[-4:] == ["--warm-pool", "32", "--memory-reserve-mb", "2048"]
    # Kubernetes expands $(VAR) only for variables defined earlier in the list.
    names = [e["name"] for e in node["env"]]
    assert names.index("NODE_NAME") < names.index("SANDBAR_DATA_DIR")
    assert spec["hostNetwork"] is True and spec["hostPID"] is False
    assert node["securityContext"]["privileged"] is True
    assert spec["nodeSelector"] == {"sandbar.dev/node": "true"}
    assert spec["tolerations"][0]["key"] == "sandbar.dev/sandboxes"
    # The data directory is the host's, mounted where SANDBAR_DATA_DIR says, with mounts
    # made under it propagated to the host.
    data_dir = env["SANDBAR_DATA_DIR"]["value"]
    assert data_dir == "/srv/sandbar"
    mounts = {m["mountPath"]: m for m in node["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts[data_dir]["mountPropagation"] == "Bidirectional"
    assert volumes[mounts[data_dir]["name"]]["hostPath"]["path"] == data_dir
    for host_path in ("/run/sandbar", "/sys/fs/cgroup", "/dev"):
        assert volumes[mounts[host_path]["name"]]["hostPath"]["path"] == host_path
    # The layer store, and its credentials as a file only root may read.
    assert env["SANDBAR_LAYER_STORE"]["value"] == "http://registry.internal:5000/sandbar/layers"
    credentials = Path(env["SANDBAR_LAYER_STORE_CREDENTIALS_FILE"]["value"])
    store_volume = volumes[mounts[str(credentials.parent)]["name"]]
    assert store_volume["secret"]["secretName"] == "sandbar-layer-store"
    assert store_volume["secret"]["defaultMode"] == 0o400
    assert store_volume["secret"]["items"] == [{"key": "credentials", "path": credentials.name}]
    # The liveness probe carries the secret, read from the mounted file.
    secret_file = env["SANDBAR_CLUSTER_SECRET_FILE"]["value"]
    for probe in ("startupProbe", "livenessProbe"):
        script = " ".join(node[probe]["exec"]["command"])
        assert "X-Sandbar-Node-Secret" in script
        assert f"cat {secret_file}" in script
        assert "${NODE_IP}:3000/health" in script


def test_the_default_node_listens_on_its_host_ip_and_restarts_on_delete():
    daemonset = only(render(MINIMAL), "DaemonSet")
    node = container(daemonset["spec"]["template"]["spec"], "node")
    assert flag_value(node["args"], "--listen") == "$(NODE_IP):3000"
    assert flag_value(node["args"], "--node-id") == "$(NODE_NAME)"
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}


@pytest.mark.parametrize("case", ["minimal", "example"])
def test_api_hosts_and_nodes_share_one_secret_and_one_database(case):
    values = MINIMAL if case == "minimal" else example_values()
    docs = render(values)
    api_spec = pod_spec(docs, "Deployment")
    node_spec = pod_spec(docs, "DaemonSet")
    api, node = container(api_spec, "api"), container(node_spec, "node")

    # The cluster secret: the API's init container copies it from the Secret into the file
    # the API reads; the node mounts the same Secret's key as that file.
    init = api_spec["initContainers"][0]
    api_ref = env_of(init)["CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    node_volume = next(v["secret"] for v in node_spec["volumes"] if "secret" in v)
    assert node_volume["secretName"] == api_ref["name"]
    assert node_volume["items"] == [{"key": api_ref["key"], "path": "secret"}]
    assert node_volume["defaultMode"] == 0o400
    secret_file = env_of(api)["SANDBAR_CLUSTER_SECRET_FILE"]["value"]
    assert env_of(node)["SANDBAR_CLUSTER_SECRET_FILE"]["value"] == secret_file
    secret_dir = str(Path(secret_file).parent)
    assert f"> {secret_file}" in init["command"][-1] and "umask 077" in init["command"][-1]
    assert any(m["mountPath"] == secret_dir for m in init["volumeMounts"])
    assert any(m["mountPath"] == secret_dir for m in api["volumeMounts"])
    assert any(m["mountPath"] == secret_dir for m in node["volumeMounts"])

    db_api = env_of(api)["SANDBAR_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    db_node = env_of(node)["SANDBAR_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert db_api == db_node
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    if case == "minimal":
        db = secrets[db_api["name"]]["data"][db_api["key"]]
        assert base64.b64decode(db).decode() == DATABASE_URL
        generated = base64.b64decode(secrets[api_ref["name"]]["data"][api_ref["key"]]).decode()
        assert len(generated) == 48
        assert set(generated) <= set(string.ascii_letters + string.digits)
    else:
        assert secrets == {}
        assert api_ref == {"name": "sandbar-cluster", "key": "secret"}
        assert db_api == {"name": "sandbar-db", "key": "url"}
        key = env_of(api)["SANDBAR_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert key == {"name": "sandbar-api-key", "key": "api-key"}
        assert env_of(node)["SANDBAR_API_KEY"]["valueFrom"]["secretKeyRef"] == key


def test_a_given_secret_and_key_are_kept_in_secrets_of_the_release():
    secret = "s" * 40
    key = "e2b_" + "0" * 40
    docs = render({**MINIMAL, "clusterSecret": {"value": secret}, "apiKey": {"value": key}})
    data = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    assert base64.b64decode(data["sandbar-cluster"]["secret"]).decode() == secret
    assert base64.b64decode(data["sandbar-api-key"]["api-key"]).decode() == key
    with pytest.raises(Exception, match="/clusterSecret/value"):
        render({**MINIMAL, "clusterSecret": {"value": "short"}})


@pytest.mark.parametrize(
    "values, where",
    [
        ({"api": {"replica": 3}}, "additional properties 'replica'"),
        ({"api": {"service": {"type": "Ingress"}}}, "/api/service/type"),
        ({"apiKey": {"value": "not-a-key"}}, "/apiKey/value"),
        ({"database": {"url": "mysql://db/sandbar"}}, "/database/url"),
        ({"node": {"dataDir": "relative"}}, "/node/dataDir"),
        ({"layerStore": {"url": "http://registry:5000/"}}, "/layerStore/url"),
        ({"layerStore": {"url": "registry:5000/sandbar/layers"}}, "/layerStore/url"),
    ],
)
def test_the_values_schema_refuses_what_sandbar_would(values, where):
    with pytest.raises(Exception, match=re.escape(where)):
        render({**MINIMAL, **values})


def test_options_reach_both_roles_as_variables_the_binary_reads():
    values = example_values()
    docs = render(values)
    flags, envs = server_options()
    assert {"--role", "--node-id", "--advertise-url", "--listen", "--warm-pool"} <= flags
    assert {"SANDBAR_ALLOW_REGISTRY", "SANDBAR_PLAIN_HTTP_REGISTRIES", "SANDBAR_DOMAIN"} <= envs
    for kind, name in (("Deployment", "api"), ("DaemonSet", "node")):
        c = container(pod_spec(docs, kind), name)
        env = env_of(c)
        assert env["SANDBAR_ALLOW_REGISTRY"]["value"] == "registry.internal:5000"
        assert env["SANDBAR_PLAIN_HTTP_REGISTRIES"]["value"] == "registry.internal:5000"
        assert env["SANDBAR_DOMAIN"]["value"] == "sandbar.example.com"
        assert env["TZ"]["value"] == "UTC"
        unknown = [n for n in env if n.startswith("SANDBAR_") and n not in envs]
        assert unknown == [], f"{name} sets variables sandbar does not read: {unknown}"
        unknown = [a for a in c["args"] if a.startswith("--") and a not in flags]
        assert unknown == [], f"{name} passes flags sandbar does not take: {unknown}"
    api = container(pod_spec(docs, "Deployment"), "api")
    assert flag_value(api["args"], "--max-upload-mb") == "2048"
    service = only(docs, "Service")
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["loadBalancerSourceRanges"] == ["203.0.113.0/24"]
    assert only(docs, "Deployment")["spec"]["replicas"] == 3


def test_metrics_are_served_only_with_a_token_from_a_secret():
    docs = render(MINIMAL)
    for kind, name in (("Deployment", "api"), ("DaemonSet", "node")):
        assert "SANDBAR_METRICS_TOKEN" not in env_of(container(pod_spec(docs, kind), name))
    token = "m" * 40
    docs = render({**MINIMAL, "metrics": {"token": token}})
    data = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    assert base64.b64decode(data["sandbar-metrics"]["token"]).decode() == token
    given = render(example_values())
    for kind, name in (("Deployment", "api"), ("DaemonSet", "node")):
        ref = env_of(container(pod_spec(docs, kind), name))["SANDBAR_METRICS_TOKEN"]
        assert ref["valueFrom"]["secretKeyRef"] == {"name": "sandbar-metrics", "key": "token"}
        ref = env_of(container(pod_spec(given, kind), name))["SANDBAR_METRICS_TOKEN"]
        assert ref["valueFrom"]["secretKeyRef"] == {"name": "sandbar-metrics", "key": "token"}
    assert not any(d["metadata"]["name"] == "sandbar-metrics" for d in given if d["kind"] == "Secret")
    with pytest.raises(Exception, match="/metrics/token"):
        render({**MINIMAL, "metrics": {"token": "has space"}})


def test_notes_say_how_to_reach_the_api():
    text = notes(MINIMAL)
    assert "E2B_API_URL" in text and "E2B_SANDBOX_URL" in text
    assert "kubectl port-forward -n sandbar svc/sandbar-api" in text
    assert "jsonpath" in notes(example_values())


# ---------------------------------------------------------------------------------------
# systemd units

UNITS = ["sandbar-api.service", "sandbar-node.service", "sandbar.service"]


def unit_settings(name):
    settings = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def units_with_stub_binary(tmp_path):
    """The units, with ExecStart pointing at a stub: systemd checks that it exists."""
    stub = tmp_path / "sandbar"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    for name in UNITS:
        text = (SYSTEMD / name).read_text().replace("/usr/local/bin/sandbar", str(stub))
        (tmp_path / name).write_text(text)
    return [tmp_path / name for name in UNITS]


def test_systemd_verifies_the_units(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the units are not verified by systemd")
    for unit in units_with_stub_binary(tmp_path):
        run = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(unit)],
            capture_output=True,
            text=True,
            check=False,
        )
        # verify exits 0 on unknown or malformed settings, which it only warns about.
        output = (run.stdout + run.stderr).strip()
        assert run.returncode == 0 and output == "", f"{unit.name}: {output}"


def test_the_api_unit_is_confined(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the API unit's exposure is not measured")
    unit = units_with_stub_binary(tmp_path)[0]
    run = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    if "--offline" in run.stderr:
        pytest.skip(f"this systemd-analyze cannot judge a unit offline: {run.stderr.strip()}")
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", run.stdout)
    assert level, run.stdout + run.stderr
    assert float(level.group(1)) <= 2.0, run.stdout


def test_the_api_user_is_declared(tmp_path):
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("systemd-sysusers is not installed: the sysusers.d file is not checked")
    conf = SYSTEMD / "sandbar-sysusers.conf"
    run = subprocess.run(
        ["systemd-sysusers", "--dry-run", f"--root={tmp_path}", str(conf)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "Creating user 'sandbar'" in run.stdout + run.stderr


def test_the_units_run_the_roles_they_are_named_for():
    api, node, single = (unit_settings(name) for name in UNITS)
    assert api["ExecStart"] == ["/usr/local/bin/sandbar serve --role api"]
    assert api["User"] == ["sandbar"] and api["ProtectSystem"] == ["strict"]
    assert api["CapabilityBoundingSet"] == [""]
    assert api["EnvironmentFile"] == ["/etc/sandbar/api.env"]
    # Not a LoadCredential= credential: systemd opens those to the user with an ACL, which
    # shows as group bits, and sandbar refuses a secret file with any.
    assert "LoadCredential" not in api
    assert "SANDBAR_CLUSTER_SECRET_FILE=/etc/sandbar/cluster-secret" in api["Environment"]
    assert node["ExecStart"] == ["/usr/local/bin/sandbar serve --role node"]
    assert node["EnvironmentFile"] == ["/etc/sandbar/node.env"]
    assert single["ExecStart"] == ["/usr/local/bin/sandbar serve --role all"]
    for unit in (node, single):
        # Sandboxes are adopted by the next start: stopping the server must not kill them.
        assert unit["KillMode"] == ["process"] and unit["Delegate"] == ["yes"]
        assert unit["User"] == ["root"]
    for unit in (api, node, single):
        assert unit["Restart"] == ["always"]


def test_example_env_files_set_only_what_sandbar_reads():
    _, envs = server_options()
    for example in sorted(SYSTEMD.glob("*.env.example")):
        for line in example.read_text().splitlines():
            line = line.lstrip("#")
            match = re.match(r"([A-Z_][A-Z0-9_]*)=", line)
            if match and match.group(1) != "RUST_LOG":
                assert match.group(1) in envs, f"{example.name}: {match.group(1)}"
    node = (SYSTEMD / "node.env.example").read_text()
    for required in ("SANDBAR_DATABASE_URL", "SANDBAR_NODE_ID", "SANDBAR_ADVERTISE_URL"):
        assert f"\n{required}=" in node


def test_the_image_has_what_the_chart_uses():
    dockerfile = (ROOT / "deploy" / "container" / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # The node's probe runs curl; API hosts run as this user; the init container runs sh.
    assert re.search(r"apt-get install[^\n]*\\\n[^\n]*\bcurl\b", dockerfile)
    assert f"--uid {values['api']['runAsUser']}" in dockerfile
    assert 'ENTRYPOINT ["/usr/local/bin/sandbar"]' in dockerfile
    for needed in ("mmdebstrap", "nftables", "iproute2", "btrfs-progs", "install-criu.sh"):
        assert needed in dockerfile
