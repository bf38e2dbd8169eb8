//! A real nginx on loopback serving a directory as an HTTP origin for bundle prefetch
//! tests: byte ranges, ETags and If-Match come from nginx's static module. Extra locations:
//! `/forbidden/` always answers 403, and `/slow/` serves the same root with a per-connection
//! rate limit (to catch a download mid-flight). Every request is logged to an access log in
//! a fixed format the tests parse to count requests and bytes sent.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;

use super::{ServiceProcess, free_port, wait_for_tcp, which};

/// One line of the access log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessEntry {
    /// Request method.
    pub method: String,
    /// Request path (without query).
    pub uri: String,
    /// Response status.
    pub status: u16,
    /// Body bytes sent.
    pub body_bytes: u64,
    /// The Range header, or `-`.
    pub range: String,
    /// The If-Match header, or `-`.
    pub if_match: String,
}

/// A running nginx. Killed on drop.
pub struct Nginx {
    /// Port on 127.0.0.1.
    pub port: u16,
    /// Directory served at `/` (and `/slow/`).
    pub root: PathBuf,
    scheme: &'static str,
    access_log: PathBuf,
    error_log: PathBuf,
    _proc: ServiceProcess,
    _dir: tempfile::TempDir,
}

/// Locate the nginx binary (`/usr/sbin` is not always on PATH).
fn nginx_bin() -> Option<PathBuf> {
    which("nginx").or_else(|| which("/usr/sbin/nginx"))
}

impl Nginx {
    /// Serve `root`; `/slow/` is limited to `slow_rate` bytes/s per connection (nginx
    /// `limit_rate` syntax, e.g. `"2m"`).
    pub fn start(root: &Path, slow_rate: &str) -> anyhow::Result<Self> {
        Self::start_with(root, slow_rate, None)
    }

    /// Serve `root` over TLS with `cert` and `key` (PEM files); [`Nginx::url`] is then
    /// `https://127.0.0.1:<port>/...`.
    pub fn start_tls(root: &Path, cert: &Path, key: &Path) -> anyhow::Result<Self> {
        Self::start_with(root, "1m", Some((cert, key)))
    }

    fn start_with(root: &Path, slow_rate: &str, tls: Option<(&Path, &Path)>) -> anyhow::Result<Self> {
        let bin = nginx_bin().context("nginx not installed (scripts/install-test-deps-prefetch.sh)")?;
        let dir = tempfile::Builder::new().prefix("tg-nginx").tempdir()?;
        let port = free_port()?;
        let access_log = dir.path().join("access.log");
        let error_log = dir.path().join("error.log");
        let d = dir.path().display();
        let root_s = root.display();
        let listen = match tls {
            None => format!("listen 127.0.0.1:{port};"),
            Some((cert, key)) => format!(
                "listen 127.0.0.1:{port} ssl;\n        ssl_certificate {};\n        ssl_certificate_key {};",
                cert.display(),
                key.display()
            ),
        };
        let conf = format!(
            r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {err} warn;
events {{ worker_connections 1024; }}
http {{
    log_format tg '$request_method $uri $status $body_bytes_sent "$http_range" "$http_if_match"';
    access_log {acc} tg;
    client_body_temp_path {d}/client;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    keepalive_timeout 60s;
    server {{
        {listen}
        root {root_s};
        location /forbidden/ {{ return 403; }}
        location /slow/ {{
            alias {root_s}/;
            limit_rate {slow_rate};
        }}
    }}
}}
"#,
            err = error_log.display(),
            acc = access_log.display(),
        );
        let conf_path = dir.path().join("nginx.conf");
        std::fs::write(&conf_path, conf)?;
        let child = Command::new(bin)
            .arg("-c")
            .arg(&conf_path)
            .arg("-p")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawning nginx")?;
        let proc = ServiceProcess::new("nginx", child);
        wait_for_tcp(&format!("127.0.0.1:{port}"), Duration::from_secs(10)).with_context(|| {
            format!(
                "nginx did not start: {}",
                std::fs::read_to_string(&error_log).unwrap_or_default()
            )
        })?;
        Ok(Nginx {
            port,
            root: root.to_path_buf(),
            scheme: if tls.is_some() { "https" } else { "http" },
            access_log,
            error_log,
            _proc: proc,
            _dir: dir,
        })
    }

    /// `http://127.0.0.1:<port>/<path>` (`https` when started with TLS).
    pub fn url(&self, path: &str) -> String {
        format!(
            "{}://127.0.0.1:{}/{}",
            self.scheme,
            self.port,
            path.trim_start_matches('/')
        )
    }

    /// Every request logged so far.
    pub fn requests(&self) -> anyhow::Result<Vec<AccessEntry>> {
        let text = match std::fs::read_to_string(&self.access_log) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).context("reading nginx access log"),
        };
        text.lines().map(parse_line).collect()
    }

    /// nginx's error log, for failure messages.
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(&self.error_log).unwrap_or_default()
    }
}

fn parse_line(line: &str) -> anyhow::Result<AccessEntry> {
    let bad = || anyhow::anyhow!("unexpected access log line {line:?}");
    let mut head = line.splitn(5, ' ');
    let method = head.next().ok_or_else(bad)?.to_string();
    let uri = head.next().ok_or_else(bad)?.to_string();
    let status = head.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let body_bytes = head.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let rest = head.next().ok_or_else(bad)?;
    let quoted: Vec<&str> = rest.split('"').filter(|s| !s.trim().is_empty()).collect();
    let range = quoted.first().ok_or_else(bad)?.to_string();
    let if_match = quoted.get(1).ok_or_else(bad)?.to_string();
    Ok(AccessEntry {
        method,
        uri,
        status,
        body_bytes,
        range,
        if_match,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn parses_log_lines() {
        let e = parse_line(r#"GET /a/b.bin 206 1024 "bytes=0-1023" "\"65f-1\"""#).unwrap();
        assert_eq!(e.status, 206);
        assert_eq!(e.body_bytes, 1024);
        assert_eq!(e.range, "bytes=0-1023");
        let e = parse_line(r#"GET /m.yaml 200 10 "-" "-""#).unwrap();
        assert_eq!(e.if_match, "-");
    }
}
