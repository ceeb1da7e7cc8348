//! The Kubernetes manifests under `deploy/kubernetes/` (docs/kubernetes.md), checked without a
//! cluster:
//!
//! - **Schema**: every manifest passes `kubernetes-validate --strict` (the PyPI package, which
//!   bundles the API's JSON schemas and runs offline) against Kubernetes 1.30 (the oldest
//!   release with the `preStop` `sleep` action the proxies use) and 1.37, and the checker
//!   refuses a manifest broken on purpose, so a checker that accepts anything fails the test.
//!   Without the checker the test prints `SKIPPED ...` and passes, except under `CI=true`, where
//!   it fails: `.ci/run` installs it (into `$PDSERVE_KUBERNETES_VALIDATE_DIR`, added to the
//!   checker's `PYTHONPATH`).
//! - **pdserve accepts what the pods run**: each StatefulSet's pdserve container's config file
//!   (from the ConfigMap generator) and environment (field references and Secrets given sample
//!   values, `$(VAR)` expanded as the kubelet does) are loaded with pdserve's own loaders
//!   (`ServeConfig::load`, `ProxyConfig::load`) in a `figment::Jail`, and the settings the
//!   manifests depend on are checked: the pod's name is its member name, it binds every
//!   interface and publishes its pod IP, probes and the `preStop` drain reach its HTTP port, the
//!   grace period covers the drain, etcd is the Service the manifests run.
//! - **Wiring**: the kustomization lists every manifest and config file, every ConfigMap and
//!   Secret a pod mounts exists or is created by a command in docs/kubernetes.md.

// `Jail::expect_with` closures must return `figment::Error`, which is large; not our API.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use pdserve_runtime::config::{ProxyConfig, ServeConfig};
use serde::Deserialize;
use serde_yaml_ng::Value;

/// The sample pod IP field references resolve to.
const POD_IP: &str = "10.244.1.7";
/// The sample value of every Secret key.
const SECRET_VALUE: &str = "sample-secret";
/// Kubernetes releases the manifests are validated against.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.30.0", "1.37.0"];
/// Names the directory `.ci/run` installs `kubernetes-validate` into (pip `--target`).
const VALIDATE_DIR_ENV: &str = "PDSERVE_KUBERNETES_VALIDATE_DIR";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

fn kustomization() -> Value {
    yaml_docs(&deploy_dir().join("kustomization.yaml")).remove(0)
}

/// The manifests `kustomization.yaml` lists, in its order.
fn manifests() -> Vec<PathBuf> {
    kustomization()["resources"]
        .as_sequence()
        .expect("kustomization.yaml: resources")
        .iter()
        .map(|r| deploy_dir().join(r.as_str().expect("a resource is a path")))
        .collect()
}

/// Every object of every manifest.
fn objects() -> Vec<Value> {
    manifests().iter().flat_map(|p| yaml_docs(p)).collect()
}

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what}: not a string: {v:?}"))
}

fn seq(v: &Value) -> &[Value] {
    v.as_sequence().map_or(&[], |s| s.as_slice())
}

// ---------------------------------------------------------------------------------------------
// Schema

/// `python3 -m kubernetes_validate` with the install directory of `.ci/run` on its path.
fn checker() -> Command {
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "kubernetes_validate"]);
    if let Some(dir) = std::env::var_os(VALIDATE_DIR_ENV) {
        let mut path = dir;
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("PYTHONPATH", path);
    }
    cmd
}

/// Runs the checker on `files` against `version`: `Ok` with its output when every resource
/// passed, `Err` with it otherwise.
fn validate(version: &str, files: &[PathBuf]) -> Result<String, String> {
    let out = checker()
        .args(["--strict", "--quiet", "-k", version])
        .args(files)
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// Why the checker cannot run here, if it cannot.
fn checker_missing() -> Option<String> {
    match checker().arg("--version").output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "kubernetes-validate is not installed ({}; pip install kubernetes-validate, or set \
             {VALIDATE_DIR_ENV} to a pip --target directory holding it)",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run python3: {e}")),
    }
}

#[test]
fn every_manifest_passes_the_kubernetes_schemas() {
    // Under the jail's lock: the config tests below swap the process environment in a jail,
    // and the checker must start with this process's own (PATH, PYTHONPATH, CI).
    figment::Jail::expect_with(|_jail| {
        check_schemas();
        Ok(())
    });
}

fn check_schemas() {
    if let Some(reason) = checker_missing() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but the manifests cannot be validated: {reason}"
        );
        eprintln!("SKIPPED: {reason} (fails instead of skipping when CI=true)");
        return;
    }
    let files = manifests();
    assert!(files.len() >= 5, "{files:?}");
    for version in KUBERNETES_VERSIONS {
        if let Err(out) = validate(version, &files) {
            panic!("deploy/kubernetes does not validate against Kubernetes {version}:\n{out}");
        }
    }
    // The negative control: the same checker refuses a manifest with a misspelt field and
    // one with a value of the wrong type, so passing above means something.
    let dir = tempfile::tempdir().unwrap();
    let prefill = std::fs::read_to_string(deploy_dir().join("prefill.yaml")).unwrap();
    for (what, from, to) in [
        ("a misspelt field", "readinessProbe:", "readynessProbe:"),
        (
            "a string where a number goes",
            "containerPort: 8100",
            "containerPort: http",
        ),
    ] {
        assert!(prefill.contains(from), "{from}");
        let broken = dir.path().join("prefill.yaml");
        std::fs::write(&broken, prefill.replacen(from, to, 1)).unwrap();
        let out = validate(KUBERNETES_VERSIONS[1], &[broken])
            .expect_err(&format!("the checker accepted {what}"));
        assert!(out.contains("statefulset/prefill"), "{what}: {out}");
    }
    // And the proxies' preStop sleep is what pins the oldest release: 1.28 lacks it.
    let out = validate("1.28.0", &[deploy_dir().join("proxy.yaml")])
        .expect_err("Kubernetes 1.28 has no preStop sleep action");
    assert!(out.contains("sleep"), "{out}");
}

// ---------------------------------------------------------------------------------------------
// Wiring

#[test]
fn the_kustomization_lists_every_manifest_and_config_file() {
    let dir = deploy_dir();
    let mut on_disk: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().is_some_and(|n| n != "kustomization.yaml")
        })
        .collect();
    on_disk.sort();
    let mut listed = manifests();
    listed.sort();
    assert_eq!(listed, on_disk, "kustomization.yaml resources");
    let configs: Vec<PathBuf> = std::fs::read_dir(dir.join("config"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let generated: Vec<PathBuf> = generated_config_maps().into_values().collect();
    for c in &configs {
        assert!(generated.contains(c), "{} is in no ConfigMap", c.display());
    }
    assert_eq!(generated.len(), configs.len(), "{generated:?}");
}

/// ConfigMap name → the one file the kustomization generates it from.
fn generated_config_maps() -> BTreeMap<String, PathBuf> {
    seq(&kustomization()["configMapGenerator"])
        .iter()
        .map(|g| {
            let files = seq(&g["files"]);
            assert_eq!(files.len(), 1, "{g:?}");
            (
                str_of(&g["name"], "configMapGenerator name").to_string(),
                deploy_dir().join(str_of(&files[0], "configMapGenerator file")),
            )
        })
        .collect()
}

#[test]
fn every_secret_a_pod_uses_is_created_by_the_docs() {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/kubernetes.md"))
            .unwrap();
    let mut secrets = Vec::new();
    for sts in objects().iter().filter(|o| o["kind"] == "StatefulSet") {
        let spec = &sts["spec"]["template"]["spec"];
        for v in seq(&spec["volumes"]) {
            if let Some(name) = v["secret"]["secretName"].as_str() {
                secrets.push(name.to_string());
            }
        }
        for c in seq(&spec["containers"])
            .iter()
            .chain(seq(&spec["initContainers"]))
        {
            for e in seq(&c["env"]) {
                if let Some(name) = e["valueFrom"]["secretKeyRef"]["name"].as_str() {
                    secrets.push(name.to_string());
                }
            }
        }
    }
    secrets.sort();
    secrets.dedup();
    assert!(secrets.len() >= 4, "{secrets:?}");
    for s in secrets {
        // The docs create the per-role credentials in a loop over the roles.
        let created = docs.contains(&format!("kubectl -n pdserve create secret generic {s}"))
            || s.strip_prefix("pdserve-")
                .and_then(|r| r.strip_suffix("-credentials"))
                .is_some_and(|role| {
                    docs.contains("create secret generic \"pdserve-$role-credentials\"")
                        && docs.contains("for role in proxy prefill decode")
                        && ["proxy", "prefill", "decode"].contains(&role)
                });
        assert!(created, "docs/kubernetes.md does not create Secret {s}");
    }
}

// ---------------------------------------------------------------------------------------------
// pdserve's config, as each pod loads it

/// One pdserve container of a StatefulSet, as its pod `NAME-0` runs it.
struct Pod {
    statefulset: String,
    name: String,
    spec: Value,
    container: Value,
    /// Its environment, resolved as the kubelet would.
    env: BTreeMap<String, String>,
}

fn pods() -> Vec<Pod> {
    objects()
        .into_iter()
        .filter(|o| o["kind"] == "StatefulSet")
        .filter_map(|sts| {
            let statefulset = str_of(&sts["metadata"]["name"], "name").to_string();
            let spec = sts["spec"]["template"]["spec"].clone();
            let container = seq(&spec["containers"])
                .iter()
                .find(|c| c["name"] == "pdserve")?
                .clone();
            let name = format!("{statefulset}-0");
            let env = resolve_env(&container, &name);
            Some(Pod {
                statefulset,
                name,
                spec,
                container,
                env,
            })
        })
        .collect()
}

/// `container`'s environment in pod `pod`: field references and Secrets given their sample
/// values, `$(VAR)` replaced by an earlier variable's value (the kubelet's rule: an unknown
/// reference stays as it is).
fn resolve_env(container: &Value, pod: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for e in seq(&container["env"]) {
        let name = str_of(&e["name"], "env name").to_string();
        let value = if let Some(v) = e["value"].as_str() {
            expand(v, &env)
        } else if let Some(field) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            match field {
                "metadata.name" => pod.to_string(),
                "status.podIP" => POD_IP.to_string(),
                other => panic!("{name}: no sample value for field {other}"),
            }
        } else if e["valueFrom"]["secretKeyRef"].is_mapping() {
            SECRET_VALUE.to_string()
        } else {
            panic!("{name}: no value: {e:?}");
        };
        env.insert(name, value);
    }
    env
}

fn expand(value: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find(')') {
            Some(end) if env.contains_key(&after[..end]) => {
                out.push_str(&env[&after[..end]]);
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str("$(");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

impl Pod {
    fn args(&self) -> Vec<&str> {
        seq(&self.container["args"])
            .iter()
            .map(|a| str_of(a, "args"))
            .collect()
    }

    /// The file `--config` names, as the ConfigMap mounted there is generated from.
    fn config_file(&self) -> PathBuf {
        let args = self.args();
        let at = args
            .iter()
            .position(|a| *a == "--config")
            .expect("--config");
        let path = args[at + 1];
        let mount = seq(&self.container["volumeMounts"])
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("{}: nothing mounted at {path}", self.name));
        let volume = self.volume(str_of(&mount["name"], "mount name"));
        let map = str_of(&volume["configMap"]["name"], "configMap name");
        let file = generated_config_maps()
            .remove(map)
            .unwrap_or_else(|| panic!("{}: no ConfigMap {map} is generated", self.name));
        let key = str_of(&mount["subPath"], "subPath");
        assert_eq!(file.file_name().unwrap().to_str(), Some(key), "{path}");
        file
    }

    fn volume(&self, name: &str) -> &Value {
        seq(&self.spec["volumes"])
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("{}: no volume {name}", self.name))
    }

    /// Where the volume that the init container lays the credentials out in is mounted.
    fn credentials_mount(&self) -> String {
        let mount = seq(&self.container["volumeMounts"])
            .iter()
            .find(|m| self.volume(str_of(&m["name"], "mount"))["emptyDir"].is_mapping())
            .expect("the credentials volume");
        str_of(&mount["mountPath"], "mountPath").to_string()
    }

    fn container_port(&self, name: &str) -> u64 {
        seq(&self.container["ports"])
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("{}: no port {name}", self.name))
    }

    /// Every probe reaches the pod's `http` port at `path`.
    fn check_probes(&self, http_port: u64) {
        assert_eq!(self.container_port("http"), http_port, "{}", self.name);
        for (probe, path) in [
            ("startupProbe", "/health/live"),
            ("livenessProbe", "/health/live"),
            ("readinessProbe", "/health"),
        ] {
            let get = &self.container[probe]["httpGet"];
            assert_eq!(get["path"], path, "{} {probe}", self.name);
            assert_eq!(get["port"], "http", "{} {probe}", self.name);
        }
    }

    fn grace_s(&self) -> u64 {
        self.spec["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("terminationGracePeriodSeconds")
    }

    /// Loads `load` inside a jail holding exactly this pod's environment.
    fn with_env<T>(&self, load: impl FnOnce() -> T) -> T {
        let mut out = None;
        figment::Jail::expect_with(|jail| {
            jail.clear_env();
            for (k, v) in &self.env {
                jail.set_env(k, v);
            }
            out = Some(load());
            Ok(())
        });
        out.expect("the jail ran")
    }
}

/// The etcd Service's client URL, `http://SERVICE:PORT`.
fn etcd_url() -> String {
    let svc = objects()
        .into_iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "etcd")
        .expect("Service etcd");
    let port = seq(&svc["spec"]["ports"])
        .iter()
        .find(|p| p["name"] == "client")
        .and_then(|p| p["port"].as_u64())
        .expect("etcd client port");
    format!("http://etcd:{port}")
}

#[test]
fn pdserve_accepts_the_config_and_environment_of_every_pod() {
    let pods = pods();
    let roles: Vec<&str> = pods.iter().map(|p| p.statefulset.as_str()).collect();
    for role in ["proxy", "prefill", "decode"] {
        assert!(roles.contains(&role), "no {role} StatefulSet: {roles:?}");
    }
    let etcd = vec![etcd_url()];
    for pod in &pods {
        let file = pod.config_file();
        match pod.args()[0] {
            "serve" => {
                let c = pod
                    .with_env(|| ServeConfig::load(Some(&file), serde_json::json!({})))
                    .unwrap_or_else(|e| panic!("{}: pdserve serve refuses it: {e}", pod.name));
                assert_eq!(c.instance.name, pod.name, "the member name is the pod's");
                assert_eq!(c.instance.role.as_str(), pod.statefulset);
                assert_eq!(c.server.host, "0.0.0.0", "{}", pod.name);
                assert_eq!(c.transfer.advertise_addr.as_deref(), Some(POD_IP));
                assert_eq!(c.server.api_key.as_deref(), Some(SECRET_VALUE));
                assert_eq!(
                    c.transfer.credentials_dir.as_deref(),
                    Some(pod.credentials_mount().as_str())
                );
                let d = &c.control.discovery;
                assert!(d.is_etcd(), "{}", pod.name);
                assert_eq!(d.etcd_endpoints, etcd, "{}", pod.name);
                pod.check_probes(u64::from(c.server.port));
                let control: std::net::SocketAddr = c.control.listen.parse().unwrap();
                assert_eq!(pod.container_port("control"), u64::from(control.port()));
                // preStop drains this instance over loopback and waits past its drain
                // timeout; the grace period covers the wait.
                let drain: Vec<&str> =
                    seq(&pod.container["lifecycle"]["preStop"]["exec"]["command"])
                        .iter()
                        .map(|a| str_of(a, "preStop"))
                        .collect();
                let url = format!("http://127.0.0.1:{}", c.server.port);
                assert_eq!(drain[..3], ["pdserve", "drain", url.as_str()], "{drain:?}");
                let wait: u64 = drain[drain.iter().position(|a| *a == "--wait").unwrap() + 1]
                    .parse()
                    .unwrap();
                assert!(wait > c.server.drain_timeout_s, "{}", pod.name);
                assert!(pod.grace_s() > wait, "{}: grace period", pod.name);
            }
            "proxy" => {
                let c = pod
                    .with_env(|| ProxyConfig::load(Some(&file), serde_json::json!({})))
                    .unwrap_or_else(|e| panic!("{}: pdserve proxy refuses it: {e}", pod.name));
                let p = &c.proxy;
                assert_eq!(p.node, pod.name, "the member name is the pod's");
                assert_eq!(p.advertise_addr.as_deref(), Some(POD_IP));
                assert_eq!(p.host, "0.0.0.0");
                assert_eq!(p.api_key.as_deref(), Some(SECRET_VALUE));
                assert_eq!(
                    p.credentials_dir.as_deref(),
                    Some(pod.credentials_mount().as_str())
                );
                assert!(p.discovery.is_etcd());
                assert_eq!(p.discovery.etcd_endpoints, etcd);
                pod.check_probes(u64::from(p.port));
                let control: std::net::SocketAddr = p.control_listen.parse().unwrap();
                assert_eq!(pod.container_port("control"), u64::from(control.port()));
                // SIGTERM drains the proxy (in-flight requests finish within
                // proxy.drain_timeout_s); the grace period covers it.
                assert!(
                    pod.grace_s() > p.drain_timeout_s,
                    "{}: grace period {} s within the proxy's drain timeout {} s",
                    pod.name,
                    pod.grace_s(),
                    p.drain_timeout_s
                );
            }
            other => panic!("{}: unexpected command {other}", pod.name),
        }
    }
}

#[test]
fn a_pod_whose_environment_pdserve_refuses_fails_the_check() {
    // The check above is only worth something if a bad environment fails it: the proxy
    // without its advertised address (bound to 0.0.0.0 with etcd), an instance with a
    // misspelt key.
    let mut pods = pods();
    let proxy = pods.iter_mut().find(|p| p.statefulset == "proxy").unwrap();
    proxy.env.remove("PDSERVE_PROXY__ADVERTISE_ADDR");
    let file = proxy.config_file();
    let e = proxy
        .with_env(|| ProxyConfig::load(Some(&file), serde_json::json!({})))
        .unwrap_err()
        .to_string();
    assert!(e.contains("proxy.advertise_addr"), "{e}");
    let decode = pods.iter_mut().find(|p| p.statefulset == "decode").unwrap();
    decode
        .env
        .insert("PDSERVE_TRANSFER__ADVERTISE_ADR".into(), POD_IP.into());
    let file = decode.config_file();
    let e = decode
        .with_env(|| ServeConfig::load(Some(&file), serde_json::json!({})))
        .unwrap_err()
        .to_string();
    assert!(e.contains("PDSERVE_TRANSFER__ADVERTISE_ADR"), "{e}");
}

#[test]
fn env_references_expand_as_the_kubelet_expands_them() {
    let env = BTreeMap::from([("POD_IP".to_string(), POD_IP.to_string())]);
    assert_eq!(expand("$(POD_IP)", &env), POD_IP);
    assert_eq!(expand("a$(POD_IP):1", &env), format!("a{POD_IP}:1"));
    assert_eq!(expand("$(NOPE)", &env), "$(NOPE)");
    assert_eq!(expand("$(", &env), "$(");
}
