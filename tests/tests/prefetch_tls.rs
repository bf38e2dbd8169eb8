//! A private CA for HTTPS sources (`models.fetch.ca_bundle`, `bundle fetch --ca-bundle`):
//! the real nginx on TLS with a certificate from a CA the test makes with openssl. The
//! fetch succeeds with the CA bundle, is refused without it (the origin is not trusted),
//! and a CA file that is not a PEM bundle is bad input naming the file.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use taintgate_prefetch::{CancellationToken, Manifest, PrefetchError, prefetch_bundles};
use taintgate_tests::agent::Agent;
use taintgate_tests::bundles::{publish_manifest, test_prefetch_options, write_origin_file};
use taintgate_tests::services::nginx::Nginx;
use taintgate_validators::reason::ReasonCode;

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir`.
fn make_pki(dir: &Path) {
    let sh = format!(
        r#"set -e
cd {d}
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj "/CN=taintgate-test-private-ca" 2>/dev/null
printf 'subjectAltName = IP:127.0.0.1\nextendedKeyUsage = serverAuth\n' > ext
openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=127.0.0.1" 2>/dev/null
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext 2>/dev/null
"#,
        d = dir.display()
    );
    let o = Command::new("sh").arg("-c").arg(sh).output().unwrap();
    assert!(o.status.success(), "openssl: {}", String::from_utf8_lossy(&o.stderr));
}

struct Origin {
    nginx: Nginx,
    _root: tempfile::TempDir,
    pki: tempfile::TempDir,
    bundle: taintgate_prefetch::BundleRef,
}

fn origin() -> Option<Origin> {
    let pki = tempfile::tempdir().unwrap();
    make_pki(pki.path());
    let root = tempfile::tempdir().unwrap();
    let nginx = taintgate_tests::services::service_or_skip(
        "nginx (TLS)",
        Nginx::start_tls(
            root.path(),
            &pki.path().join("server.pem"),
            &pki.path().join("server.key"),
        ),
    )?;
    let files = vec![
        write_origin_file(root.path(), "model/a.bin", 3 << 20, 1, None)
            .unwrap()
            .0,
        write_origin_file(root.path(), "model/b.bin", 1 << 20, 2, None)
            .unwrap()
            .0,
    ];
    let m = Manifest { base_uri: None, files };
    let bundle = publish_manifest(root.path(), "manifest.yaml", "llm", nginx.url("manifest.yaml"), &m).unwrap();
    assert!(bundle.manifest_uri.starts_with("https://"), "{}", bundle.manifest_uri);
    Some(Origin {
        nginx,
        _root: root,
        pki,
        bundle,
    })
}

#[tokio::test]
async fn the_private_ca_is_trusted_only_when_configured() {
    let Some(o) = origin() else { return };
    // Without the CA: the origin's certificate is not trusted, nothing is fetched.
    let cache = tempfile::tempdir().unwrap();
    let e = prefetch_bundles(
        std::slice::from_ref(&o.bundle),
        &test_prefetch_options(cache.path()),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(
        !matches!(e, PrefetchError::OptionsInvalid { .. }),
        "a TLS failure, not bad options: {e}"
    );
    assert!(
        format!("{e:?}").to_lowercase().contains("certificate"),
        "the error says the certificate is not trusted ({}): {e:?}",
        e.reason()
    );
    // With it: fetched and verified over TLS.
    let mut opts = test_prefetch_options(cache.path());
    opts.ca_bundle = Some(o.pki.path().join("ca.pem"));
    let r = prefetch_bundles(std::slice::from_ref(&o.bundle), &opts, CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", e.reason(), o.nginx.error_log()));
    assert_eq!(r.bytes_fetched, 4 << 20);
    assert!(
        o.nginx
            .requests()
            .unwrap()
            .iter()
            .any(|r| r.uri.ends_with("a.bin") && r.status == 206),
        "ranged GETs reached the TLS origin"
    );
}

#[test]
fn bundle_fetch_takes_a_ca_bundle_and_names_a_bad_one() {
    let Some(o) = origin() else { return };
    let cache = tempfile::tempdir().unwrap();
    let run = |ca: &Path| {
        Agent::new([
            "bundle",
            "fetch",
            &o.bundle.manifest_uri,
            "--sha256",
            &o.bundle.manifest_sha256,
        ])
        .arg("--cache")
        .arg(cache.path())
        .args(["--reserve", "0", "--ca-bundle"])
        .arg(ca)
        .no_timeout()
        .output()
        .unwrap()
    };
    let ok = run(&o.pki.path().join("ca.pem"));
    assert_eq!(ok.status.code(), Some(0), "{}", String::from_utf8_lossy(&ok.stderr));
    let bad = o.pki.path().join("not-a-ca.pem");
    std::fs::write(&bad, "hello\n").unwrap();
    let out = run(&bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("not-a-ca.pem") && err.contains("ca_bundle"), "{err}");
}
