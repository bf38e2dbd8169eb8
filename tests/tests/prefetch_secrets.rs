//! Secrets never reach a message (issue 48), checked on every path a `models` failure
//! takes to a person, for every kind of secret a bundle source can carry:
//!
//! - kinds: URL userinfo (`http://alice:PASSWORD@host/`); S3 presigned `X-Amz-Signature`,
//!   `X-Amz-Credential`, `X-Amz-Security-Token`; Azure SAS `sig`; GCS signed URL
//!   `X-Goog-Signature`; and the value of a secret `models.fetch.source_options` key (an
//!   Azure SAS key, which the store client appends to every request URL it then quotes in
//!   its errors);
//! - paths: `taintgate bundle fetch`'s error message and log lines (stdout and stderr);
//!   the real agent (`run --simulate`, real kube-apiserver) — its log lines, the Node
//!   condition, the timeline annotation, the Events it wrote, the JSON timeline it
//!   printed — and the trace it exported over OTLP (the `models` span's status message
//!   and attributes).
//!
//! Every check is two-sided: the secret occurs nowhere, and its masked form (`alice:***@`,
//! `X-Amz-Signature=***`, ...) does, so a message that lost the URI altogether fails too.
//! The origin is nginx on loopback; the failures are its real 404s.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use taintgate_prefetch::{Manifest, ManifestFile};
use taintgate_tests::agent::{Agent, NODE, condition, output_text, profile, reference_node};
use taintgate_tests::bundles::{publish_manifest, write_origin_file};
use taintgate_tests::cluster::ApiServer;
use taintgate_tests::otlp::OtlpReceiver;
use taintgate_tests::require_service;
use taintgate_tests::services::nginx::Nginx;

const PASSWORD: &str = "s3cr3tPW-userinfo";
const AMZ_SIGNATURE: &str = "a1b2c3amzsignature9f8e7d";
const AMZ_CREDENTIAL: &str = "AKIAAMZCREDENTIAL42";
const AMZ_TOKEN: &str = "FQoGZXIvYXdzSessionToken42";
const AZ_SIG: &str = "AzSasSignature42xyz";
const GOOG_SIGNATURE: &str = "0badc0degoogsignature42";
/// The signature inside the SAS key given as a source option.
const OPT_SAS_SIG: &str = "OptionSasSignature42";
/// A secret option whose value no store ever quotes: it must stay absent everywhere.
const OPT_SECRET_KEY: &str = "wJalrXUtnFEMIK7MDENGbPxRfiCYsecretkey42";

/// One kind of secret: the string that must never appear, and the masked form that must.
struct Kind {
    name: &'static str,
    secret: &'static str,
    masked: &'static str,
}

const KINDS: &[Kind] = &[
    Kind {
        name: "userinfo",
        secret: PASSWORD,
        masked: "alice:***@",
    },
    Kind {
        name: "X-Amz-Signature",
        secret: AMZ_SIGNATURE,
        masked: "X-Amz-Signature=***",
    },
    Kind {
        name: "X-Amz-Credential",
        secret: AMZ_CREDENTIAL,
        masked: "X-Amz-Credential=***",
    },
    Kind {
        name: "X-Amz-Security-Token",
        secret: AMZ_TOKEN,
        masked: "X-Amz-Security-Token=***",
    },
    Kind {
        name: "Azure SAS sig",
        secret: AZ_SIG,
        masked: "sig=***",
    },
    Kind {
        name: "X-Goog-Signature",
        secret: GOOG_SIGNATURE,
        masked: "X-Goog-Signature=***",
    },
];

/// The query of a signed URL carrying every signed-URL kind at once.
fn signed_query() -> String {
    format!(
        "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={AMZ_CREDENTIAL}%2F20261207%2Fus-east-1%2Fs3%2Faws4_request\
         &X-Amz-Date=20261207T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host\
         &X-Amz-Security-Token={AMZ_TOKEN}&X-Amz-Signature={AMZ_SIGNATURE}\
         &sv=2022-11-02&sp=r&sig={AZ_SIG}&X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Signature={GOOG_SIGNATURE}"
    )
}

/// Assert `text` (what `path` showed) holds no secret of `kinds` and each one's masked form.
fn assert_redacted(path: &str, text: &str, kinds: &[&Kind]) {
    for k in kinds {
        let n = text.matches(k.secret).count();
        assert_eq!(n, 0, "{path}: the {} secret appears {n} time(s):\n{text}", k.name);
        assert!(
            text.contains(k.masked),
            "{path}: the masked {} ({}) is missing:\n{text}",
            k.name,
            k.masked
        );
    }
}

/// Assert no secret at all (of any kind, options included) is in `text`.
fn assert_no_secret(path: &str, text: &str) {
    for s in KINDS
        .iter()
        .map(|k| k.secret)
        .chain([OPT_SAS_SIG, OPT_SECRET_KEY, PASSWORD])
    {
        assert!(!text.contains(s), "{path}: secret {s:?} appears:\n{text}");
    }
}

/// A one-file manifest whose file is fetched from `source` (absent at the origin: a real
/// 404).
fn manifest_with_source(origin: &Path, source: String) -> Manifest {
    let (mut f, _) = write_origin_file(origin, "present.bin", 1000, 1, None).unwrap();
    f.path = "weights.bin".into();
    f.source = Some(source);
    let files: Vec<ManifestFile> = vec![f];
    Manifest { base_uri: None, files }
}

/// Run `taintgate bundle fetch` and return everything it printed; it must fail with
/// `reason` and exit 1 (held).
fn bundle_fetch(args: &[&str], cache: &Path, reason: &str) -> String {
    let o = Agent::new(["bundle", "fetch"])
        .args(args)
        .arg("--cache")
        .arg(cache)
        .args(["--reserve", "0"])
        .output()
        .unwrap();
    let text = output_text(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("error ({reason})")), "{text}");
    text
}

#[test]
fn bundle_fetch_prints_no_secret_of_any_kind() {
    let origin = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "1m"));
    let cache = tempfile::tempdir().unwrap();
    let host = nginx.url("").trim_end_matches('/').replace("http://", "");

    // Userinfo: the manifest and its base URI carry a password (nginx ignores the
    // Authorization header the client makes of it); the file is missing at the origin.
    let m = Manifest {
        base_uri: Some(format!("http://alice:{PASSWORD}@{host}/missing/")),
        files: vec![write_origin_file(origin.path(), "w.bin", 1000, 2, None).unwrap().0],
    };
    let b = publish_manifest(
        origin.path(),
        "userinfo.yaml",
        "userinfo",
        format!("http://alice:{PASSWORD}@{host}/userinfo.yaml"),
        &m,
    )
    .unwrap();
    let text = bundle_fetch(
        &[&b.manifest_uri, "--sha256", &b.manifest_sha256, "--name", "userinfo"],
        cache.path(),
        "SourceNotFound",
    );
    assert_redacted("bundle fetch (userinfo)", &text, &[&KINDS[0]]);
    assert_no_secret("bundle fetch (userinfo)", &text);

    // Each signed-URL kind on its own: a file whose source is a presigned URL (the query
    // names the object's signature; the origin serves by path), and the manifest's own
    // URI signed the same way.
    for (i, k) in KINDS.iter().enumerate().skip(1) {
        let query = signed_query()
            .split('&')
            .filter(|p| {
                let name = p.split('=').next().unwrap_or("");
                // Keep the kind under test and every parameter that is no secret.
                name.eq_ignore_ascii_case(k.masked.trim_end_matches("=***"))
                    || !KINDS.iter().any(|o| o.masked.trim_end_matches("=***") == name)
            })
            .collect::<Vec<_>>()
            .join("&");
        let m = manifest_with_source(origin.path(), format!("http://{host}/missing/weights{i}.bin?{query}"));
        let rel = format!("signed{i}.yaml");
        let b = publish_manifest(
            origin.path(),
            &rel,
            "signed",
            format!("http://{host}/{rel}?{query}"),
            &m,
        )
        .unwrap();
        let text = bundle_fetch(
            &[&b.manifest_uri, "--sha256", &b.manifest_sha256, "--name", "signed"],
            cache.path(),
            "SourceNotFound",
        );
        let path = format!("bundle fetch ({})", k.name);
        assert_redacted(&path, &text, &[k]);
        assert_no_secret(&path, &text);
    }

    // A secret source option: the Azure client appends the SAS key's pairs to every
    // request URL, and its errors quote that URL. nginx stands in as the blob endpoint
    // (a real 404 for the missing blob).
    let sas = format!("sv=2022-11-02&sp=r&sig={OPT_SAS_SIG}");
    let text = bundle_fetch(
        &[
            "az://models/missing.yaml",
            "--sha256",
            &"0".repeat(64),
            "--opt",
            &format!("azure_storage_endpoint=http://{host}/account"),
            "--opt",
            "azure_storage_account_name=account",
            "--opt",
            &format!("azure_storage_sas_key={sas}"),
            "--opt",
            &format!("aws_secret_access_key={OPT_SECRET_KEY}"),
            "--opt",
            "allow_http=true",
        ],
        cache.path(),
        "SourceNotFound",
    );
    assert_no_secret("bundle fetch (source option)", &text);
    assert!(text.contains("az://models/missing.yaml"), "{text}");
}

/// The agent's config: one bundle at `manifest_uri`, source options `options`.
fn agent_config(dir: &Path, manifest_uri: &str, options: &[(&str, String)]) -> String {
    let cfg = dir.join("config.yaml");
    let mut text = format!(
        "models:\n  bundles:\n    - name: demo\n      manifest_uri: {manifest_uri:?}\n      manifest_sha256: {}\n  fetch:\n    cache_dir: {:?}\n    reserve_bytes: 0\n",
        "0".repeat(64),
        dir.join("cache").display().to_string()
    );
    if !options.is_empty() {
        text.push_str("    source_options:\n");
        for (k, v) in options {
            text.push_str(&format!("      {k}: {v:?}\n"));
        }
    }
    std::fs::write(&cfg, text).unwrap();
    cfg.to_string_lossy().into_owned()
}

/// Everything the agent left about the `models` failure, path by path.
struct Shown {
    /// The agent's stdout (the JSON timeline) and stderr (its log lines).
    output: String,
    condition: String,
    annotations: String,
    /// Our Events' messages.
    events: Vec<String>,
    /// The `models` span's status message.
    span_status: String,
    /// Every exported span, attributes included.
    spans: String,
}

/// Run the agent once (simulated GPU node, real kube-apiserver, OTLP to `rx`) with
/// `config`; the `models` stage fails with `reason` and the node is held.
async fn run_agent_held(api: &ApiServer, rx: &OtlpReceiver, config: String, reason: &str) -> Shown {
    let agent = Agent::run()
        .simulate(profile("8gpu-two-domains"))
        .api(api)
        .once()
        .config(config)
        .json()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint());
    let before = rx.spans().len();
    let o = tokio::task::spawn_blocking(move || agent.output().unwrap())
        .await
        .unwrap();
    let output = output_text(&o);
    assert_eq!(o.status.code(), Some(1), "held: {output}");
    let node = api.get_object("nodes", NODE).unwrap().unwrap();
    let c = condition(&node, "TaintgateVerified").unwrap_or_else(|| panic!("no condition: {node:#}"));
    assert_eq!(c["reason"], reason, "{c:#}");
    let events: Vec<String> = api
        .list_objects("events")
        .unwrap()
        .into_iter()
        .filter(|e| e["reportingComponent"] == "taintgate" && e["involvedObject"]["name"] == NODE)
        .map(|e| e["message"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(!events.is_empty(), "no Event from the agent");
    // The agent exports before it exits; wait for its spans beyond the earlier runs'.
    let mut spans = Vec::new();
    for _ in 0..50 {
        spans = rx.spans();
        if spans.len() > before && spans[before..].iter().any(|s| s.name == "models") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let spans = spans.split_off(before);
    let models = spans
        .iter()
        .find(|s| s.name == "models")
        .unwrap_or_else(|| panic!("no models span: {spans:#?}"));
    Shown {
        output,
        condition: c["message"].as_str().unwrap_or("").to_string(),
        annotations: node["metadata"]["annotations"].to_string(),
        events,
        span_status: models.status_message.clone(),
        spans: format!("{spans:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_never_reports_a_secret_on_any_path() {
    let origin = tempfile::tempdir().unwrap();
    let nginx = require_service!("nginx", Nginx::start(origin.path(), "1m"));
    let api = require_service!("kube-apiserver", ApiServer::start().await);
    api.put_object(reference_node(true).build()).unwrap();
    let rx = OtlpReceiver::start().await.unwrap();
    let host = nginx.url("").trim_end_matches('/').replace("http://", "");

    // 1. A manifest URI with every URI kind at once (userinfo and a signed query), absent
    //    at the origin: a real 404.
    let dir = tempfile::tempdir().unwrap();
    let uri = format!(
        "http://alice:{PASSWORD}@{host}/missing/manifest.yaml?{}",
        signed_query()
    );
    let shown = run_agent_held(&api, &rx, agent_config(dir.path(), &uri, &[]), "SourceNotFound").await;
    let all: Vec<&Kind> = KINDS.iter().collect();
    assert_redacted("agent output (logs, JSON timeline)", &shown.output, &all);
    assert_redacted("Node condition", &shown.condition, &all);
    assert_redacted("timeline annotation", &shown.annotations, &all);
    let events = shown.events.join("\n");
    assert_redacted("Events", &events, &all);
    assert_redacted("models span status", &shown.span_status, &all);
    assert_no_secret("exported spans", &shown.spans);

    // 2. Secret source options (an Azure SAS key the client puts in every request URL,
    //    an AWS secret key), blob absent at the blob endpoint (nginx): nothing of either.
    let dir = tempfile::tempdir().unwrap();
    let options = [
        ("azure_storage_endpoint", format!("http://{host}/account")),
        ("azure_storage_account_name", "account".to_string()),
        ("azure_storage_sas_key", format!("sv=2022-11-02&sp=r&sig={OPT_SAS_SIG}")),
        ("aws_secret_access_key", OPT_SECRET_KEY.to_string()),
        ("allow_http", "true".to_string()),
    ];
    let shown = run_agent_held(
        &api,
        &rx,
        agent_config(dir.path(), "az://models/missing.yaml", &options),
        "SourceNotFound",
    )
    .await;
    for (path, text) in [
        ("agent output", &shown.output),
        ("Node condition", &shown.condition),
        ("timeline annotation", &shown.annotations),
        ("Events", &shown.events.join("\n")),
        ("models span status", &shown.span_status),
        ("exported spans", &shown.spans),
    ] {
        assert_no_secret(path, text);
    }
    assert!(
        shown.condition.contains("az://models/missing.yaml"),
        "{}",
        shown.condition
    );
}
