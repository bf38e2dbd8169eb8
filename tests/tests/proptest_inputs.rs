//! Property tests over every untrusted input the agent reads: its config, simulated node
//! profiles, bundle manifests, the device plugin's config, CDI specs, the kubelet's own
//! config files (for the disk reserve), and the API objects
//! (Node JSON) the taint, condition and re-gate logic works on. Each property runs 10,000
//! generated inputs (`PROPTEST_CASES` overrides) and asserts: no panic; every rejection
//! says where (a key path or a line) and what; inputs that are accepted satisfy the
//! safety invariants (only our taint entry removed, other taints kept in order, bundle
//! paths stay under the cache root, the timeline annotation stays within its bound).
//!
//! Two generators are used for documents: random token soup (YAML syntax and the
//! schema's own key names, to reach deep into the parsers), and structural mutation of a
//! valid document (delete a key, change a value's type, add an unknown key) where the
//! expected outcome is known and the error must name the key that was changed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use json_patch::Patch;
use k8s_openapi::api::core::v1::Node;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};
use std::path::{Component, Path};
use std::sync::OnceLock;
use taintgate::config::{Config, ReportingConfig, TaintConfig, TaintEffect};
use taintgate::node::regate::{add_taint_patch, needs_regate};
use taintgate::node::report::{ConditionValue, compact_timeline, condition_patch, truncate};
use taintgate::node::untaint::{removal_patch, taint_index};
use taintgate::stages::is_registered;
use taintgate_prefetch::manifest::{BundleRef, Manifest};
use taintgate_validators::input::{InputError, parse_yaml};
use taintgate_validators::kubelet::cdi::parse_spec;
use taintgate_validators::kubelet::eviction::{Threshold, disk_thresholds, kubelet_thresholds};
use taintgate_validators::kubelet::plugin_config::{PluginConfig, expected_allocatable};
use taintgate_validators::kubelet::process;
use taintgate_validators::profile::NodeProfile;
use taintgate_validators::reason::ReasonCode;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(10_000)
}

fn pt_config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        // Failures print the minimal input; no regression files are written into the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------------ generic machinery

/// One step of a key path.
#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Key(String),
    Idx(usize),
}

/// The path as `serde_path_to_error` prints it (`a.b[2].c`), which is what errors name.
fn fmt_path(p: &[Seg]) -> String {
    let mut s = String::new();
    for seg in p {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Idx(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// Every node of a document except the root.
fn all_paths(v: &Value) -> Vec<Vec<Seg>> {
    fn walk(v: &Value, prefix: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
        match v {
            Value::Object(m) => {
                for (k, c) in m {
                    prefix.push(Seg::Key(k.clone()));
                    out.push(prefix.clone());
                    walk(c, prefix, out);
                    prefix.pop();
                }
            }
            Value::Array(a) => {
                for (i, c) in a.iter().enumerate() {
                    prefix.push(Seg::Idx(i));
                    out.push(prefix.clone());
                    walk(c, prefix, out);
                    prefix.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(v, &mut Vec::new(), &mut out);
    out
}

fn get_mut<'a>(v: &'a mut Value, p: &[Seg]) -> Option<&'a mut Value> {
    let mut cur = v;
    for seg in p {
        cur = match seg {
            Seg::Key(k) => cur.get_mut(k.as_str())?,
            Seg::Idx(i) => cur.get_mut(*i)?,
        };
    }
    Some(cur)
}

/// A structural change to a valid document.
#[derive(Debug, Clone)]
enum Mutation {
    /// Remove the key (or array element).
    Delete,
    /// Replace the value.
    Replace(Value),
    /// Add an unknown key to the object at the path (or its parent when not an object).
    AddUnknown(String),
}

fn wrong_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!([1, 2])),
        Just(json!({"x": 1})),
        Just(json!("text")),
        Just(json!("")),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1.5e300)),
        Just(json!(true)),
        Just(Value::Null),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u32>().prop_map(|n| json!(n)),
        "[a-zA-Z0-9 ./:_-]{0,24}".prop_map(|s| json!(s)),
        any::<String>().prop_map(|s| json!(s)),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => Just(Mutation::Delete),
        3 => wrong_value().prop_map(Mutation::Replace),
        1 => "[a-z][a-zA-Z_]{2,12}".prop_map(|k| Mutation::AddUnknown(format!("{k}_unknown"))),
    ]
}

/// What a mutation did, for the assertions.
#[derive(Debug)]
struct Applied {
    /// The path changed (for an added key: the key's own path).
    path: String,
    /// The new value's JSON shape cannot stand where the old one stood (object vs scalar
    /// or array), so a typed parser must refuse it.
    shape_mismatch: bool,
    /// An unknown key was added to an object.
    unknown_key: bool,
    /// A key (not an array element) was deleted.
    deleted_key: bool,
}

fn shape(v: &Value) -> u8 {
    match v {
        Value::Object(_) => 0,
        Value::Array(_) => 1,
        Value::Null => 3,
        _ => 2,
    }
}

fn apply(doc: &mut Value, path: &[Seg], m: &Mutation) -> Applied {
    let (parent, last) = path.split_at(path.len() - 1);
    let mut out = Applied {
        path: fmt_path(path),
        shape_mismatch: false,
        unknown_key: false,
        deleted_key: false,
    };
    match m {
        Mutation::Delete => {
            let p = get_mut(doc, parent).unwrap();
            match (&last[0], p) {
                (Seg::Key(k), Value::Object(o)) => {
                    o.remove(k);
                    out.deleted_key = true;
                }
                (Seg::Idx(i), Value::Array(a)) => {
                    a.remove(*i);
                }
                _ => unreachable!("paths come from the document"),
            }
        }
        Mutation::Replace(v) => {
            let slot = get_mut(doc, path).unwrap();
            let (old, new) = (shape(slot), shape(v));
            // Null stands for an absent Option: anything may replace it except a shape
            // the field cannot take, which we cannot know; only count object<->non-object
            // and array<->scalar swaps of non-null values.
            out.shape_mismatch = old != 3 && new != 3 && old != new;
            *slot = v.clone();
        }
        Mutation::AddUnknown(k) => {
            let target = match get_mut(doc, path) {
                Some(Value::Object(_)) => path.to_vec(),
                _ => parent.to_vec(),
            };
            if let Some(Value::Object(o)) = get_mut(doc, &target) {
                // Structs serialize every field; an object that is empty in the valid
                // template is a map (user-chosen keys), where a new key is legitimate.
                out.unknown_key = !o.is_empty();
                o.insert(k.clone(), json!(1));
                let mut p = target.clone();
                p.push(Seg::Key(k.clone()));
                out.path = fmt_path(&p);
            }
        }
    }
    out
}

/// Whether an error's key names the changed path: the same path, a path inside it, or
/// (for errors reported at the enclosing object) a parent of it.
fn key_names(e: &InputError, path: &str) -> bool {
    let Some(k) = e.key.as_deref() else { return false };
    let inside = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}.")) || a.starts_with(&format!("{b}["));
    inside(k, path) || (inside(path, k) && !k.is_empty())
}

/// Every rejection says where (key or line) and what, and names its file.
fn well_formed(e: &InputError, file: &str) -> Result<(), TestCaseError> {
    // Only a whole-document problem (several YAML documents in one file) has no location.
    prop_assert!(
        e.key.is_some() || e.line.is_some() || e.message.contains("more than one document"),
        "no key and no line: {e:?}"
    );
    prop_assert!(!e.message.trim().is_empty(), "empty message: {e:?}");
    prop_assert!(e.to_string().contains(file), "does not name the file: {e}");
    Ok(())
}

/// YAML token soup: syntax, the schema's key names, odd scalars.
fn yaml_soup(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
    let syntax = prop::sample::select(vec![
        ":",
        ": ",
        " ",
        "\n",
        "\n  ",
        "\n    ",
        "- ",
        "{",
        "}",
        "[",
        "]",
        ",",
        "'",
        "\"",
        "&a ",
        "*a",
        "!!str ",
        "!!binary ",
        "? ",
        "|\n  ",
        ">-\n  ",
        "#",
        "---\n",
        "...\n",
        "\t",
        "%YAML 1.2\n",
        "<<: *a\n",
    ]);
    let scalars = prop::sample::select(vec![
        "10s",
        "0s",
        "-1",
        "1e999",
        "null",
        "~",
        "true",
        "NaN",
        ".inf",
        "0x10",
        "18446744073709551616",
        "NoSchedule",
        "v1",
        "é\u{0}",
        "taintgate.io/unverified",
        "🙂",
    ]);
    let key = prop::sample::select(keys.to_vec());
    let token = prop_oneof![
        3 => syntax.prop_map(str::to_string),
        3 => key.prop_map(|k| format!("{k}: ")),
        2 => scalars.prop_map(str::to_string),
        1 => "[ -~]{0,12}",
    ];
    prop::collection::vec(token, 0..60).prop_map(|t| t.concat())
}

// --------------------------------------------------------------------------- config

const CONFIG_KEYS: &[&str] = &[
    "taint",
    "key",
    "effect",
    "reporting",
    "annotation_prefix",
    "condition_type",
    "hardware_condition_type",
    "events",
    "event_namespace",
    "annotation_max_bytes",
    "stages",
    "register",
    "driver",
    "smoke",
    "peer-bw",
    "allocatable",
    "device-plugin",
    "runtime",
    "fit",
    "models",
    "images",
    "enabled",
    "required",
    "deadline",
    "retries",
    "gpu",
    "expect",
    "xid",
    "fatal",
    "ignore",
    "gpu_count",
    "instance_type",
    "instance_types",
    "peer_bw",
    "efficiency",
    "busbw_gbps",
    "pair_gbps",
    "api",
    "untaint_deadline",
    "backoff_min",
    "backoff_max",
    "regate_on_boot",
    "continuous",
    "xid_wait",
];

fn config_template() -> &'static (Value, Vec<Vec<Seg>>) {
    static T: OnceLock<(Value, Vec<Vec<Seg>>)> = OnceLock::new();
    T.get_or_init(|| {
        let v = serde_json::to_value(Config::default()).unwrap();
        let p = all_paths(&v);
        (v, p)
    })
}

/// Every other case as YAML (block style, multi-line: errors carry real line numbers),
/// the rest as JSON (also YAML; cheaper to produce).
fn config_text(v: &Value, yaml: bool) -> String {
    if yaml {
        serde_yaml_ng::to_string(v).unwrap()
    } else {
        serde_json::to_string_pretty(v).unwrap()
    }
}

proptest! {
    #![proptest_config(pt_config())]

    /// Random YAML never panics the config parser; every rejection says where and what.
    #[test]
    fn config_soup_never_panics(text in yaml_soup(CONFIG_KEYS)) {
        if let Err(e) = Config::parse(Path::new("soup.yaml"), &text) {
            well_formed(&e, "soup.yaml")?;
        }
    }

    /// A valid config changed in one place: deleting a key falls back to its default (still
    /// valid); a value of the wrong shape or an unknown key is refused, naming that key.
    #[test]
    fn config_mutation_names_the_key(at in any::<Index>(), m in mutation(), yaml in any::<bool>()) {
        let (template, paths) = config_template();
        let mut doc = template.clone();
        let path = at.get(paths).clone();
        let applied = apply(&mut doc, &path, &m);
        let text = config_text(&doc, yaml);
        match Config::parse(Path::new("c.yaml"), &text) {
            Ok(_) => {
                prop_assert!(!applied.shape_mismatch, "accepted a {m:?} at {}:\n{text}", applied.path);
                prop_assert!(!applied.unknown_key, "accepted unknown key {}:\n{text}", applied.path);
            }
            Err(e) => {
                well_formed(&e, "c.yaml")?;
                prop_assert!(!applied.deleted_key, "deleting {} must fall back to the default: {e}", applied.path);
                if applied.shape_mismatch || applied.unknown_key {
                    prop_assert!(
                        key_names(&e, &applied.path) || e.message.contains(applied.path.rsplit('.').next().unwrap_or("")),
                        "error does not name {}: {e}", applied.path
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------- node profile

/// The builtin profile cut to two GPUs (one per peer domain) with two NVLinks each: every
/// key of the schema is still there, and each case parses in well under a millisecond.
fn profile_template() -> &'static (Value, Vec<Vec<Seg>>) {
    static T: OnceLock<(Value, Vec<Vec<Seg>>)> = OnceLock::new();
    T.get_or_init(|| {
        let mut p = NodeProfile::load("builtin").unwrap();
        p.gpus.retain(|g| g.index == 0 || g.index == 4);
        for g in &mut p.gpus {
            g.nvlinks.truncate(2);
        }
        for d in &mut p.domains {
            d.gpus.retain(|g| *g == 0 || *g == 4);
        }
        p.validate(Path::new("template")).unwrap();
        let v = serde_json::to_value(p).unwrap();
        let paths = all_paths(&v);
        (v, paths)
    })
}

fn json_patch_op() -> impl Strategy<Value = Value> {
    let path = prop::sample::select(vec![
        "/gpus/0",
        "/gpus/7/uuid",
        "/gpus/-",
        "/gpus/99",
        "/domains/0/gpus",
        "/node/name",
        "/node/taints/0",
        "/faults/xid_during_validation",
        "/latencies_ms/driver",
        "/bandwidth/pair_gbps",
        "/",
        "",
        "/nonexistent/deeper",
        "/gpus/0/health",
        "/gpus/1/index",
    ]);
    let op = prop::sample::select(vec!["add", "remove", "replace", "move", "copy", "test", "bogus"]);
    (op, path, wrong_value(), path_from())
        .prop_map(|(op, path, value, from)| json!({"op": op, "path": path, "value": value, "from": from}))
}

fn path_from() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["/gpus/1", "/node", "/x"])
}

proptest! {
    #![proptest_config(pt_config())]

    /// The builtin profile changed in one place: no panic, refusals name the key, and a
    /// profile that is accepted drives the driver decision without panicking.
    #[test]
    fn profile_mutation_names_the_key(at in any::<Index>(), m in mutation()) {
        let (template, paths) = profile_template();
        let mut doc = template.clone();
        let path = at.get(paths).clone();
        let applied = apply(&mut doc, &path, &m);
        let text = serde_json::to_string(&doc).unwrap();
        let file = Path::new("p.yaml");
        let parsed = parse_yaml::<NodeProfile>(file, &text).and_then(|p| p.validate(file).map(|_| p));
        match parsed {
            Ok(p) => {
                prop_assert!(!applied.shape_mismatch, "accepted a {m:?} at {}", applied.path);
                let inv = taintgate_validators::gpu::Inventory {
                    gpus: p.gpus.clone(),
                    domains: p.domains.clone(),
                    nics: p.nics.clone(),
                    nvswitch_sxids: Vec::new(),
                };
                let _ = taintgate_validators::gpu::decide::evaluate_driver(&inv, &Default::default());
                // The pair rule over whatever topology the profile states: an answer, no panic.
                for d in &inv.domains {
                    for &a in &d.gpus {
                        for &b in &d.gpus {
                            let path = taintgate_validators::gpu::decide::pair_path(&inv, d, a, b);
                            let _ = path.as_ref().map(taintgate_validators::gpu::decide::pair_path_gbps);
                        }
                    }
                }
            }
            Err(e) => {
                well_formed(&e, "p.yaml")?;
                if applied.shape_mismatch {
                    prop_assert!(key_names(&e, &applied.path) || e.line.is_some(), "error does not name {}: {e}", applied.path);
                }
            }
        }
    }
}

proptest! {
    // The node profile gets its 10,000 cases from the mutation property above; overlays
    // loaded from disk (with `extends:`) add a fifth of that.
    #![proptest_config(ProptestConfig { cases: cases() / 5, ..pt_config() })]

    /// `extends:` + `patch:` overlays with random JSON Patch operations, loaded from disk
    /// through `NodeProfile::load` (base: the two-GPU template, the builtin, a missing
    /// file, or itself): no panic, rejections name `patch`, `extends` or a key.
    #[test]
    fn profile_extends_with_random_patch(
        ops in prop::collection::vec(json_patch_op(), 0..4),
        extends in prop_oneof![
            16 => Just("base.yaml"),
            1 => Just("builtin"),
            1 => Just("missing.yaml"),
            1 => Just("self.yaml"),
        ],
    ) {
        // One directory for the whole run (cases run one after another on one thread).
        static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
        let dir = DIR.get_or_init(|| {
            let d = tempfile::tempdir().unwrap();
            std::fs::write(d.path().join("base.yaml"), serde_json::to_string(&profile_template().0).unwrap()).unwrap();
            d
        });
        let file = dir.path().join("self.yaml");
        let doc = json!({"extends": extends, "patch": ops});
        std::fs::write(&file, serde_json::to_string(&doc).unwrap()).unwrap();
        if let Err(e) = NodeProfile::load(&file.to_string_lossy()) {
            prop_assert!(e.key.is_some() || e.line.is_some() || e.message.contains("cannot read"), "{e:?}");
            prop_assert!(!e.message.trim().is_empty());
        }
    }
}

// ------------------------------------------------------------------ bundle manifest

fn rel_path() -> impl Strategy<Value = String> {
    let comp = prop::sample::select(vec![
        "a",
        "b",
        "model.safetensors",
        "..",
        ".",
        "",
        "é",
        "a\\b",
        "c\0d",
        " ",
        "...",
        "~",
        "-x",
    ]);
    prop_oneof![
        prop::collection::vec(comp, 1..5).prop_map(|c| c.join("/")),
        Just("/etc/passwd".to_string()),
        Just("C:\\x".to_string()),
        any::<String>(),
    ]
}

fn manifest_file() -> impl Strategy<Value = Value> {
    let digest = prop_oneof![
        3 => "[0-9a-f]{64}",
        1 => "[0-9a-fA-Fg]{0,70}",
    ];
    (
        rel_path(),
        any::<u64>(),
        digest,
        prop::option::of("[a-z]{1,5}://[a-z./]{0,10}|[ a-z./]{0,6}"),
    )
        .prop_map(
            |(path, size, sha256, source)| json!({"path": path, "size": size, "sha256": sha256, "source": source}),
        )
}

/// A path accepted into the cache cannot leave the bundle directory.
fn stays_under_root(p: &str) -> bool {
    let root = Path::new("/cache/bundles/b");
    let joined = root.join(p);
    !Path::new(p).is_absolute()
        && Path::new(p).components().all(|c| matches!(c, Component::Normal(_)))
        && joined.starts_with(root)
        && !p.split('/').any(|c| c.is_empty() || c == "." || c == "..")
}

proptest! {
    #![proptest_config(pt_config())]

    /// Random manifests: accepted ones keep every file under the bundle root with a
    /// well-formed digest and unique paths; rejected ones say `ManifestInvalid` and name
    /// the manifest.
    #[test]
    fn manifest_paths_cannot_escape(files in prop::collection::vec(manifest_file(), 0..6), yaml in any::<bool>()) {
        let doc = json!({"files": files});
        let text = if yaml { serde_yaml_ng::to_string(&doc).unwrap() } else { doc.to_string() };
        match Manifest::parse(text.as_bytes(), "s3://b/m.yaml") {
            Ok(m) => {
                let mut seen = std::collections::BTreeSet::new();
                for f in &m.files {
                    prop_assert!(stays_under_root(&f.path), "accepted unsafe path {:?}", f.path);
                    prop_assert!(f.sha256.len() == 64 && f.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
                    prop_assert!(seen.insert(f.path.clone()), "duplicate {:?}", f.path);
                }
            }
            Err(e) => {
                prop_assert_eq!(e.reason().as_str(), "ManifestInvalid");
                prop_assert!(e.to_string().contains("s3://b/m.yaml"), "{e}");
            }
        }
    }

    /// Arbitrary bytes (not UTF-8, not YAML) are refused, never a panic.
    #[test]
    fn manifest_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Err(e) = Manifest::parse(&bytes, "m.json") {
            prop_assert_eq!(e.reason().as_str(), "ManifestInvalid");
        }
    }

    /// A bundle reference's name becomes a directory: only a single safe component passes.
    #[test]
    fn bundle_name_is_one_component(name in prop_oneof![rel_path(), "[a-z0-9-]{1,12}"], digest in "[0-9a-f]{64}|[0-9a-z]{0,64}") {
        let r = BundleRef { name: name.clone(), manifest_uri: "s3://b/m".into(), manifest_sha256: digest };
        if r.validate().is_ok() {
            let mut comps = Path::new(&name).components();
            prop_assert!(matches!(comps.next(), Some(Component::Normal(_))) && comps.next().is_none(), "{name:?}");
            prop_assert!(!name.starts_with('.') && !name.contains('\\'));
        }
    }
}

// ------------------------------------------------------------- device plugin config

fn plugin_template() -> Value {
    json!({
        "version": "v1",
        "flags": {"migStrategy": "none", "failOnInitError": true},
        "sharing": {"timeSlicing": {"renameByDefault": false, "resources": [
            {"name": "nvidia.com/gpu", "replicas": 4},
            {"name": "nvidia.com/mig-1g.10gb", "replicas": 2, "devices": "all"}
        ]}}
    })
}

const PLUGIN_KEYS: &[&str] = &[
    "version",
    "flags",
    "migStrategy",
    "sharing",
    "timeSlicing",
    "mps",
    "renameByDefault",
    "resources",
    "name",
    "replicas",
    "devices",
    "rename",
];

proptest! {
    #![proptest_config(pt_config())]

    /// The plugin config changed in one place: refusals name the key; accepted configs
    /// yield an expected-allocatable answer (or a typed refusal) for the reference node.
    #[test]
    fn plugin_config_mutation(at in any::<Index>(), m in mutation()) {
        let mut doc = plugin_template();
        let paths = all_paths(&doc);
        let path = at.get(&paths).clone();
        let applied = apply(&mut doc, &path, &m);
        let text = serde_yaml_ng::to_string(&doc).unwrap();
        match PluginConfig::parse(Path::new("dp.yaml"), &text) {
            Ok(cfg) => {
                // Replicas are materialised as device IDs: keep this property bounded in
                // memory (see the report on unbounded replicas).
                let replicas: u64 = cfg.replicated().map(|r| r.resources.iter().map(|x| u64::from(x.replicas)).sum()).unwrap_or(1);
                if replicas <= 100_000 {
                    let _ = expected_allocatable(reference_inventory(), &cfg);
                }
                let _ = cfg.warnings();
            }
            Err(e) => {
                well_formed(&e, "dp.yaml")?;
                if applied.unknown_key && !applied.path.starts_with("flags.") {
                    prop_assert!(key_names(&e, &applied.path) || e.message.contains("unknown field"), "{}: {e}", applied.path);
                }
            }
        }
    }

    #[test]
    fn plugin_config_soup_never_panics(text in yaml_soup(PLUGIN_KEYS)) {
        if let Err(e) = PluginConfig::parse(Path::new("dp.yaml"), &text) {
            well_formed(&e, "dp.yaml")?;
        }
    }
}

// ------------------------------------------------------------- kubelet config files

const KUBELET_KEYS: &[&str] = &[
    "evictionHard",
    "evictionSoft",
    "nodefs.available",
    "imagefs.available",
    "memory.available",
    "imageGCHighThresholdPercent",
    "kind",
];

/// A kubelet threshold value: the kubelet's forms and near misses.
fn threshold_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u32..=120, prop::bool::ANY).prop_map(|(p, dot)| if dot { format!("{p}.5%") } else { format!("{p}%") }),
        prop::sample::select(vec![
            "0%",
            "100%",
            "5Gi",
            "0",
            "-1Gi",
            "1e3",
            "10%%",
            "%",
            "Gi",
            "1.5T",
            "99999999999999999999Ei"
        ])
        .prop_map(str::to_string),
        "[-0-9.%GiKMTPE ]{0,10}",
    ]
}

proptest! {
    #![proptest_config(pt_config())]

    /// Whatever is in the kubelet's config file: no panic, each problem names the file and
    /// where, every threshold in force is at most the whole disk, one per setting.
    #[test]
    fn kubelet_config_soup_never_panics(text in yaml_soup(KUBELET_KEYS)) {
        thread_local!(static DIR: tempfile::TempDir = tempfile::tempdir().unwrap());
        let f = DIR.with(|d| d.path().join("config.yaml"));
        std::fs::write(&f, &text).unwrap();
        let t = disk_thresholds(std::slice::from_ref(&f));
        for e in &t.errors {
            well_formed(e, "config.yaml")?;
        }
        let mut keys: Vec<&str> = t.found.iter().map(|x| x.key.as_str()).collect();
        keys.dedup();
        prop_assert_eq!(keys.len(), t.found.len(), "{:?}", t.found);
        for x in &t.found {
            if let Threshold::PartsPerMillion(p) = x.threshold {
                prop_assert!(p <= 1_000_000, "{x}");
            }
        }
    }

    /// A threshold value: parsed as the kubelet does or refused with a reason; a share is
    /// never over 100%, "0%" and "100%" are off.
    #[test]
    fn kubelet_threshold_values(text in threshold_text()) {
        match Threshold::parse(&text) {
            Ok(None) => prop_assert!(text == "0%" || text == "100%", "{text:?} off"),
            Ok(Some(Threshold::PartsPerMillion(p))) => {
                prop_assert!(text.ends_with('%') && p <= 1_000_000, "{text:?} -> {p}")
            }
            Ok(Some(Threshold::Bytes(b))) => prop_assert!(!text.ends_with('%') && b > 0, "{text:?} -> {b}"),
            Err(why) => prop_assert!(why.contains(&text), "{text:?}: {why}"),
        }
    }
}

/// A kubelet command-line argument: the flags read, their near misses, values and noise.
fn kubelet_arg() -> impl Strategy<Value = String> {
    let flag = prop::sample::select(vec![
        "--config",
        "--config-dir",
        "--config_dir",
        "--eviction-hard",
        "--eviction_hard",
        "--eviction-soft",
        "--image-gc-high-threshold",
        "--v",
        "--",
        "-config",
        "---config",
    ]);
    let value = prop_oneof![
        threshold_text(),
        prop::sample::select(vec![
            "nodefs.available",
            "imagefs.available",
            "memory.available",
            "",
            " "
        ])
        .prop_map(str::to_string),
        "[-a-z./<,=% 0-9]{0,24}",
    ];
    prop_oneof![
        (flag.clone(), value.clone()).prop_map(|(f, v)| format!("{f}={v}")),
        flag.prop_map(str::to_string),
        value,
        (threshold_text(), threshold_text())
            .prop_map(|(a, b)| format!("--eviction-hard=nodefs.available<{a},imagefs.available<{b}")),
    ]
}

proptest! {
    #![proptest_config(pt_config())]

    /// Whatever another process's command line holds: no panic, each problem names the
    /// command line and the flag, and the thresholds made of it are one per setting and at
    /// most the whole disk.
    #[test]
    fn kubelet_command_line_soup_never_panics(args in prop::collection::vec(kubelet_arg(), 0..12)) {
        let mut argv = vec!["kubelet".to_string()];
        argv.extend(args);
        let mut cmd = process::parse(4242, &argv);
        for e in &cmd.errors {
            prop_assert!(e.to_string().contains("/proc/4242/cmdline"), "{e}");
            prop_assert!(e.key.as_deref().is_some_and(|k| k.starts_with("--")), "{e:?}");
        }
        // The soup's paths (`/`, `.`) must not read or walk the test machine's own files.
        for slot in [&mut cmd.config, &mut cmd.config_dir] {
            if let Some(p) = slot.take() {
                let p = p.strip_prefix("/").unwrap_or(&p).to_path_buf();
                *slot = Some(std::path::Path::new("/nonexistent-proptest").join(p));
            }
        }
        let t = kubelet_thresholds(&cmd, &[]);
        let mut keys: Vec<&str> = t.found.iter().map(|x| x.key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        prop_assert_eq!(keys.len(), t.found.len(), "{:?}", t.found);
        for x in &t.found {
            if let Threshold::PartsPerMillion(p) = x.threshold {
                prop_assert!(p <= 1_000_000, "{x}");
            }
        }
        for e in &t.errors {
            prop_assert!(!e.message.trim().is_empty(), "{e:?}");
        }
    }

    /// The occurrences of a `<`-map flag merge in order, in either form, with or without
    /// `_`: the pairs read are exactly the pairs written.
    #[test]
    fn kubelet_map_flag_occurrences_merge_in_order(
        items in prop::collection::vec(
            (prop::bool::ANY, prop::bool::ANY, prop::collection::vec(("[a-z.]{1,12}", "[0-9]{1,2}%"), 0..3)),
            1..5,
        )
    ) {
        let mut argv = vec!["kubelet".to_string()];
        let mut want = Vec::new();
        for (inline, underscore, pairs) in &items {
            let name = if *underscore { "--eviction_soft" } else { "--eviction-soft" };
            let value: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}<{v}")).collect();
            if *inline {
                argv.push(format!("{name}={}", value.join(",")));
            } else {
                argv.push(name.to_string());
                argv.push(value.join(","));
            }
            want.extend(pairs.iter().cloned());
        }
        let cmd = process::parse(1, &argv);
        prop_assert!(cmd.errors.is_empty(), "{:?}", cmd.errors);
        prop_assert_eq!(cmd.eviction_soft, Some(want));
    }
}

fn reference_inventory() -> &'static taintgate_validators::gpu::Inventory {
    static I: OnceLock<taintgate_validators::gpu::Inventory> = OnceLock::new();
    I.get_or_init(|| {
        let p = NodeProfile::load("builtin").unwrap();
        taintgate_validators::gpu::Inventory {
            gpus: p.gpus,
            domains: p.domains,
            nics: p.nics,
            nvswitch_sxids: Vec::new(),
        }
    })
}

// ------------------------------------------------------------------------- CDI spec

fn cdi_template() -> Value {
    json!({
        "cdiVersion": "0.6.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
            {"name": "GPU-5f1c0a0e-8b3d-4c2a-9f6e-000000000000",
             "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]}}
        ],
        "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"}], "env": ["A=1"]}
    })
}

const CDI_KEYS: &[&str] = &[
    "cdiVersion",
    "kind",
    "devices",
    "name",
    "containerEdits",
    "deviceNodes",
    "path",
    "hostPath",
    "env",
];

proptest! {
    #![proptest_config(pt_config())]

    /// CDI specs changed in one place: no panic; refusals name the key or line; accepted
    /// specs have absolute device node paths and a vendor/class kind.
    #[test]
    fn cdi_spec_mutation(at in any::<Index>(), m in mutation()) {
        let mut doc = cdi_template();
        let paths = all_paths(&doc);
        let path = at.get(&paths).clone();
        let _ = apply(&mut doc, &path, &m);
        let text = serde_yaml_ng::to_string(&doc).unwrap();
        match parse_spec(Path::new("nvidia.yaml"), &text) {
            Ok(spec) => {
                prop_assert!(spec.kind.split_once('/').is_some_and(|(v, c)| !v.is_empty() && !c.is_empty()));
                for d in &spec.devices {
                    for n in &d.container_edits.device_nodes {
                        prop_assert!(n.path.starts_with('/'), "{:?}", n.path);
                    }
                }
            }
            Err(e) => well_formed(&e, "nvidia.yaml")?,
        }
    }

    #[test]
    fn cdi_soup_never_panics(text in yaml_soup(CDI_KEYS)) {
        if let Err(e) = parse_spec(Path::new("nvidia.yaml"), &text) {
            well_formed(&e, "nvidia.yaml")?;
        }
    }
}

// ---------------------------------------------------------------- API objects (Node)

const OUR_KEY: &str = "taintgate.io/unverified";

fn taint() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        4 => prop::sample::select(vec![OUR_KEY, "nvidia.com/gpu", "karpenter.sh/unregistered", "example.com/a", "node.kubernetes.io/not-ready"]).prop_map(str::to_string),
        1 => "[a-z./-]{0,20}",
    ];
    let effect = prop_oneof![
        4 => prop::sample::select(vec!["NoSchedule", "PreferNoSchedule", "NoExecute"]).prop_map(str::to_string),
        1 => "[A-Za-z]{0,10}",
    ];
    (key, effect, prop::option::of("[a-z]{0,6}")).prop_map(|(k, e, v)| {
        let mut t = json!({"key": k, "effect": e});
        if let Some(v) = v {
            t["value"] = json!(v);
        }
        t
    })
}

fn condition() -> impl Strategy<Value = Value> {
    let t = prop::sample::select(vec![
        "Ready",
        "TaintgateVerified",
        "AcceleratedHardwareReady",
        "MemoryPressure",
        "X",
    ]);
    let s = prop::sample::select(vec!["True", "False", "Unknown"]);
    (t, s, prop::option::of(Just("2026-01-01T00:00:00Z"))).prop_map(|(t, s, ts)| {
        let mut c = json!({"type": t, "status": s});
        if let Some(ts) = ts {
            c["lastTransitionTime"] = json!(ts);
        }
        c
    })
}

fn node_json() -> impl Strategy<Value = Value> {
    let registered = prop::option::of(prop::sample::select(vec!["true", "false", "TRUE", ""]));
    let no_sync = prop::option::of(prop::sample::select(vec!["true", "false"]));
    let boot = prop::option::of(prop::sample::select(vec!["boot-1", "boot-2", ""]));
    (
        prop::option::of(prop::collection::vec(taint(), 0..7)),
        prop::option::of(prop::collection::vec(condition(), 0..5)),
        registered,
        no_sync,
        boot,
        any::<bool>(),
        1u32..1000,
    )
        .prop_map(|(taints, conditions, reg, nosync, boot, with_spec, rv)| {
            let mut n = json!({"metadata": {"name": "n", "resourceVersion": rv.to_string(), "labels": {}}});
            if let Some(r) = reg {
                n["metadata"]["labels"]["karpenter.sh/registered"] = json!(r);
            }
            if let Some(s) = nosync {
                n["metadata"]["labels"]["karpenter.sh/do-not-sync-taints"] = json!(s);
            }
            if let Some(b) = boot {
                n["metadata"]["annotations"] = json!({"taintgate.io/released-boot-id": b});
            }
            // The API server always serializes `spec` and `status` (Go structs), possibly
            // empty; `with_spec == false` is a Node whose spec has no fields at all.
            n["spec"] = json!({});
            n["status"] = json!({});
            if with_spec && let Some(t) = taints {
                n["spec"]["taints"] = json!(t);
            }
            if let Some(c) = conditions {
                n["status"]["conditions"] = json!(c);
            }
            n
        })
}

fn taint_config() -> impl Strategy<Value = TaintConfig> {
    let effect = prop::sample::select(vec![
        TaintEffect::NoSchedule,
        TaintEffect::PreferNoSchedule,
        TaintEffect::NoExecute,
    ]);
    (
        prop::sample::select(vec![OUR_KEY, "nvidia.com/gpu", "example.com/a"]),
        effect,
    )
        .prop_map(|(k, effect)| TaintConfig {
            key: k.to_string(),
            effect,
        })
}

/// Up to ~1.1 KB of mostly two-byte characters, so the 1024-byte message bound cuts inside
/// them; built by repetition because a 1,000-character regex strategy is slow to sample.
fn long_text() -> impl Strategy<Value = String> {
    ("[a-z🙂é\" ]{0,16}", 0usize..1100).prop_map(|(p, n)| format!("{p}{}", "é".repeat(n / 2)))
}

fn taints_of(doc: &Value) -> Vec<Value> {
    doc["spec"]["taints"].as_array().cloned().unwrap_or_default()
}

fn is_ours(t: &Value, cfg: &TaintConfig) -> bool {
    t["key"] == cfg.key.as_str() && t["effect"] == cfg.effect.as_str()
}

proptest! {
    #![proptest_config(pt_config())]

    /// The taint removal: the index found is the first entry with our key and effect; the
    /// patch removes exactly that entry and keeps every other taint in order; built for a
    /// stale index it is refused and leaves the Node unchanged.
    #[test]
    fn removal_patch_removes_only_our_entry(raw in node_json(), cfg in taint_config(), other in taint()) {
        let node: Node = serde_json::from_value(raw.clone()).unwrap();
        let doc = raw.clone();
        let before = taints_of(&doc);
        match taint_index(&node, &cfg) {
            None => prop_assert!(!before.iter().any(|t| is_ours(t, &cfg))),
            Some(i) => {
                prop_assert!(is_ours(&before[i], &cfg));
                prop_assert!(!before[..i].iter().any(|t| is_ours(t, &cfg)), "not the first match");
                let mut patched = doc.clone();
                json_patch::patch(&mut patched, &removal_patch(i, &cfg)).unwrap();
                let mut want = before.clone();
                want.remove(i);
                prop_assert_eq!(taints_of(&patched), want);
                let mut rest = patched.clone();
                rest["spec"].as_object_mut().unwrap().remove("taints");
                let mut rest_before = doc.clone();
                rest_before["spec"].as_object_mut().unwrap().remove("taints");
                prop_assert_eq!(rest, rest_before, "only spec.taints may change");

                // Another writer inserted a taint in front: the stale patch must fail whole.
                let mut moved = doc.clone();
                moved["spec"]["taints"].as_array_mut().unwrap().insert(0, other.clone());
                let snapshot = moved.clone();
                let r = json_patch::patch(&mut moved, &removal_patch(i, &cfg));
                if !is_ours(&taints_of(&snapshot)[i], &cfg) {
                    prop_assert!(r.is_err(), "stale patch applied to {:?}", taints_of(&snapshot));
                    prop_assert_eq!(moved, snapshot, "a refused patch changed the document");
                }
            }
        }
    }

    /// Registration follows Karpenter's contract exactly.
    #[test]
    fn registration_predicate(raw in node_json()) {
        let node: Node = serde_json::from_value(raw.clone()).unwrap();
        let labels = &raw["metadata"]["labels"];
        let unregistered = taints_of(&raw).iter().any(|t| t["key"] == "karpenter.sh/unregistered");
        let want = (labels["karpenter.sh/registered"] == "true" || labels["karpenter.sh/do-not-sync-taints"] == "true")
            && !unregistered;
        prop_assert_eq!(is_registered(&node), want);
    }

    /// A condition write sets exactly our condition and keeps every other in order.
    #[test]
    fn condition_patch_touches_only_our_type(raw in node_json(), status in any::<bool>(), msg in long_text(), type_ in prop::sample::select(vec!["TaintgateVerified", "AcceleratedHardwareReady"])) {
        let mut doc = raw.clone();
        let node: Node = serde_json::from_value(raw).unwrap();
        let before: Vec<Value> = doc["status"]["conditions"].as_array().cloned().unwrap_or_default();
        let c = ConditionValue { type_: type_.into(), status, reason: taintgate::reasons::Reason::Released, message: msg };
        let now: jiff::Timestamp = "2026-02-02T00:00:00Z".parse().unwrap();
        let p: Patch = condition_patch(&node, &c, now);
        json_patch::patch(&mut doc, &p).unwrap();
        let after: Vec<Value> = doc["status"]["conditions"].as_array().cloned().unwrap_or_default();
        let ours: Vec<&Value> = after.iter().filter(|x| x["type"] == type_).collect();
        prop_assert!(!ours.is_empty());
        prop_assert_eq!(&ours[0]["status"], &json!(if status { "True" } else { "False" }));
        prop_assert!(ours[0]["message"].as_str().unwrap().len() <= 1024);
        let others_before: Vec<&Value> = before.iter().filter(|x| x["type"] != type_).collect();
        let others_after: Vec<&Value> = after.iter().filter(|x| x["type"] != type_).collect();
        prop_assert_eq!(others_before, others_after);
        // The patched Node is still a valid Node.
        let _: Node = serde_json::from_value(doc).unwrap();
    }

    /// Re-gate only a released, untainted node under another boot; the add patch appends
    /// our taint and keeps the others.
    #[test]
    fn regate_decision_and_patch(raw in node_json(), boot in prop::sample::select(vec!["boot-1", "boot-2"])) {
        let node: Node = serde_json::from_value(raw.clone()).unwrap();
        let cfg = TaintConfig::default();
        let rep = ReportingConfig::default();
        let released_under = raw["metadata"]["annotations"]["taintgate.io/released-boot-id"].as_str();
        let want = released_under.is_some_and(|b| b != boot) && taint_index(&node, &cfg).is_none();
        prop_assert_eq!(needs_regate(&node, &cfg, &rep, boot), want);
        let mut doc = raw.clone();
        let before = taints_of(&doc);
        let r = json_patch::patch(&mut doc, &add_taint_patch(&node, &cfg));
        if doc.get("spec").is_some() || r.is_ok() {
            prop_assert!(r.is_ok(), "{r:?}");
            let after = taints_of(&doc);
            prop_assert_eq!(&after[..before.len()], &before[..]);
            prop_assert!(is_ours(after.last().unwrap(), &cfg));
        }
    }

}

proptest! {
    // Output bounds of the report, not an input parser: a fifth of the cases.
    #![proptest_config(ProptestConfig { cases: cases() / 5, ..pt_config() })]

    /// The timeline annotation never exceeds its bound, and is always JSON.
    #[test]
    fn compact_timeline_is_bounded(n in 0usize..40, msg in "[a-z é🙂\"\\\\]{0,160}", max in 512usize..12_000) {
        use taintgate::timeline::{Outcome, StageRecord, Timeline};
        let t = Timeline {
            node: "n".into(),
            agent_start: jiff::Timestamp::UNIX_EPOCH,
            gpu_backend: "simulated".into(),
            stages: (0..n).map(|i| StageRecord {
                stage: taintgate::stage::RecordKind::Stage(taintgate::stage::Stage::ALL[i % taintgate::stage::Stage::ALL.len()]),
                start: jiff::Timestamp::UNIX_EPOCH,
                start_ms: i as u64,
                duration_ms: 1,
                outcome: if i % 7 == 3 { Outcome::Failed } else { Outcome::Passed },
                required: true,
                attempts: 1,
                // Reasons are a closed type now; the longest codes are the worst case.
                reason: Some(taintgate::reasons::Reason::ALL[i % taintgate::reasons::Reason::ALL.len()]),
                message: Some(msg.clone()),
                summary: String::new(),
                evidence: taintgate::evidence::Detail::None,
            }).collect(),
            verdict: None,
        };
        let s = compact_timeline(&t, max);
        prop_assert!(s.len() <= max, "{} > {max}", s.len());
        prop_assert!(serde_json::from_str::<Value>(&s).is_ok());
    }

    /// Message truncation respects the byte bound and UTF-8 boundaries.
    #[test]
    fn truncate_is_bounded(s in ".{0,300}", max in 3usize..400) {
        let t = truncate(&s, max);
        prop_assert!(t.len() <= max);
        if s.len() <= max {
            prop_assert_eq!(t, s);
        }
    }
}
