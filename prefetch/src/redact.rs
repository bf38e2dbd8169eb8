//! Secrets never reach a message: the one function, [`redact`], that every URI, source
//! option and error text of the model prefetch passes through where it becomes text (an
//! error's `Display` and `Debug`, a log field, a report) before it can reach a log line, a
//! metric label, a span, an annotation, a Node condition or an Event.
//!
//! What it masks, wherever it stands in the text (a bare URI, or a URI quoted inside an
//! error from a store or an HTTP client):
//! - URL userinfo: `http://alice:s3cr3t@host/` becomes `http://alice:***@host/`, and a
//!   user with no password (often a token: `https://TOKEN@host/`) becomes `***@`;
//! - the query parameters that carry a signature, a credential or a session token (S3
//!   presigned `X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`; Azure SAS
//!   `sig`; GCS signed URLs `X-Goog-Signature`, `X-Goog-Credential`; the V2 forms
//!   `Signature`, `AWSAccessKeyId`, `GoogleAccessId`; OAuth `access_token`): the value
//!   becomes `***`, the name stays so a reader sees which kind of URI it was;
//! - the values of the secret `models.fetch.source_options` (access keys, secret keys,
//!   session tokens, SAS keys, client secrets, service-account keys), once
//!   [`register_source_options`] has seen them: anywhere in the text, as typed or
//!   percent-encoded.
//!
//! Redaction runs before any clipping of long values (`text_bounds::clip_message`): a URI
//! cut inside its userinfo has no `@` left to find. It is idempotent and never panics, on
//! any input (malformed URIs, unicode, control characters).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::RwLock;

/// What stands where a secret was.
pub const MASK: &str = "***";

/// Query parameter names (compared ASCII case-insensitively) whose value is a secret.
const SECRET_PARAMS: &[&str] = &[
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
    "x-goog-signature",
    "x-goog-credential",
    "sig",
    "signature",
    "awsaccesskeyid",
    "googleaccessid",
    "access_token",
];

/// Fragments of a `source_options` key (lower-cased) that make its value a secret:
/// `aws_access_key_id`, `aws_secret_access_key`, `aws_session_token`,
/// `azure_storage_account_key`, `azure_storage_sas_key`, `azure_client_secret`,
/// `google_service_account_key`, and the like.
const SECRET_KEY_PARTS: &[&str] = &["secret", "key", "token", "password", "sas", "credential"];

/// Shortest option value masked in free text: a value shorter than this (`true`, a
/// region) is no credential, and masking it everywhere would garble messages.
const MIN_SECRET_VALUE: usize = 8;

/// The secret option values seen so far in this process, longest first. A process-wide
/// list because a message can be formed far from the options (an error from inside a
/// store client), and [`redact`] must cover it wherever it is formed.
static SECRET_VALUES: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Whether a `source_options` key holds a secret (its value is masked in every message).
pub fn is_secret_option(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    SECRET_KEY_PARTS.iter().any(|p| k.contains(p))
}

/// Remember the values of the secret keys of `options` so that [`redact`] masks them in
/// any text from now on, as typed and percent-encoded. Values shorter than 8 bytes are
/// not credentials and are left alone. Options that are not secrets (an endpoint, a
/// region) stay readable in messages.
pub fn register_source_options(options: &BTreeMap<String, String>) {
    let mut add: Vec<String> = Vec::new();
    for (k, v) in options {
        if !is_secret_option(k) || v.len() < MIN_SECRET_VALUE {
            continue;
        }
        add.push(v.clone());
        let encoded: String = url::form_urlencoded::byte_serialize(v.as_bytes()).collect();
        if encoded != *v {
            add.push(encoded);
        }
    }
    if add.is_empty() {
        return;
    }
    // A poisoned lock still holds a valid list: a panic elsewhere must not turn
    // redaction off.
    let mut values = SECRET_VALUES.write().unwrap_or_else(|p| p.into_inner());
    for v in add {
        if !values.contains(&v) {
            values.push(v);
        }
    }
    // Longest first, so a value that contains another is masked whole.
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
}

/// `text` with every secret it carries masked: URL userinfo, the query parameters that
/// carry signatures and credentials, and the registered secret option values (see the
/// module's documentation). Borrowed when there was nothing to mask.
pub fn redact(text: &str) -> Cow<'_, str> {
    // Values first, as typed: masking a URI's parts could cut through a value that
    // spans them.
    let mut out = Cow::Borrowed(text);
    if let Some(s) = mask_values(&out) {
        out = Cow::Owned(s);
    }
    if let Some(s) = mask_userinfo(&out) {
        out = Cow::Owned(s);
    }
    if let Some(s) = mask_query_params(&out) {
        out = Cow::Owned(s);
    }
    out
}

/// A byte that ends a URL in running text: blanks, control characters and the quotes
/// and brackets a URL never holds unencoded.
fn ends_url(b: u8) -> bool {
    b.is_ascii_whitespace() || b.is_ascii_control() || matches!(b, b'"' | b'<' | b'>' | b'`')
}

/// Position of `needle` in `hay` at or after `from`.
fn find(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Mask the userinfo of every `scheme://user:pass@host` in `text`; `None` when none.
///
/// The authority runs from `://` to the first `/`, `?`, `#` or end of the URL, and the
/// userinfo to its last `@`. A password with an unencoded `/` (not a valid URI, but typed
/// so in a config) makes the authority end early; then the part after its last `:` is not
/// a port, and the userinfo runs to the next `@` before the URL ends.
fn mask_userinfo(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut out = String::new();
    let (mut copied, mut from, mut changed) = (0, 0, false);
    while let Some(sep) = find(b, from, b"://") {
        let start = sep + 3;
        let url_end = (start..b.len()).find(|&i| ends_url(b[i])).unwrap_or(b.len());
        let auth_end = (start..url_end)
            .find(|&i| matches!(b[i], b'/' | b'?' | b'#'))
            .unwrap_or(url_end);
        let at = match b[start..auth_end].iter().rposition(|&c| c == b'@') {
            Some(p) => Some(start + p),
            None if port_is_malformed(&text[start..auth_end]) => b[auth_end..url_end]
                .iter()
                .position(|&c| c == b'@')
                .map(|p| auth_end + p),
            None => None,
        };
        from = start;
        let Some(at) = at else { continue };
        let userinfo = &text[start..at];
        let masked = match userinfo.find(':') {
            Some(colon) if colon > 0 => format!("{}:{MASK}", &userinfo[..colon]),
            _ => MASK.to_string(),
        };
        if masked != userinfo {
            out.push_str(&text[copied..start]);
            out.push_str(&masked);
            copied = at;
            changed = true;
        }
        from = at + 1;
    }
    changed.then(|| {
        out.push_str(&text[copied..]);
        out
    })
}

/// Whether an authority with no `@` ends in something that is not a port (`alice:pa`
/// of `alice:pa/ss@host`): the sign of a password holding an unencoded `/`. An IPv6
/// literal's colons are not a port.
fn port_is_malformed(authority: &str) -> bool {
    if authority.starts_with('[') {
        return false;
    }
    match authority.rsplit_once(':') {
        Some((_, port)) => !port.bytes().all(|c| c.is_ascii_digit()),
        None => false,
    }
}

/// A byte that ends a query parameter's value: the next parameter, the fragment, the end
/// of the URL, or a closing quote or bracket of the text around it (no signature,
/// credential or token, base64, hex or percent-encoded, holds one).
fn ends_value(b: u8) -> bool {
    ends_url(b) || matches!(b, b'&' | b'#' | b'\'' | b')' | b']' | b'}' | b'\\' | b',' | b';')
}

/// Mask the value of every secret query parameter (`?name=value` or `&name=value`, also
/// the HTML-escaped `&amp;name=`) in `text`; `None` when none.
fn mask_query_params(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut out = String::new();
    let (mut copied, mut i, mut changed) = (0, 0, false);
    while i < b.len() {
        if !matches!(b[i], b'?' | b'&') {
            i += 1;
            continue;
        }
        let name_start = i + 1;
        let Some(eq) = (name_start..b.len().min(name_start + 64))
            // `;` may stand in a name: the HTML-escaped `&amp;name`.
            .take_while(|&j| b[j] == b';' || (!ends_value(b[j]) && b[j] != b'?'))
            .find(|&j| b[j] == b'=')
        else {
            i += 1;
            continue;
        };
        let name = &text[name_start..eq];
        let name = name.strip_prefix("amp;").unwrap_or(name);
        if !SECRET_PARAMS.iter().any(|p| p.eq_ignore_ascii_case(name)) {
            i = eq + 1;
            continue;
        }
        let value_end = (eq + 1..b.len()).find(|&j| ends_value(b[j])).unwrap_or(b.len());
        if &text[eq + 1..value_end] != MASK {
            out.push_str(&text[copied..=eq]);
            out.push_str(MASK);
            copied = value_end;
            changed = true;
        }
        i = value_end;
    }
    changed.then(|| {
        out.push_str(&text[copied..]);
        out
    })
}

/// Mask every registered secret option value in `text`; `None` when none occurs.
fn mask_values(text: &str) -> Option<String> {
    let values = SECRET_VALUES.read().unwrap_or_else(|p| p.into_inner());
    let mut out: Option<String> = None;
    for v in values.iter() {
        let cur = out.as_deref().unwrap_or(text);
        if cur.contains(v.as_str()) {
            out = Some(cur.replace(v.as_str(), MASK));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// (input, expected output) for every kind of secret, in a bare URI and inside the
    /// messages stores and HTTP clients write.
    const CASES: &[(&str, &str)] = &[
        // Userinfo.
        (
            "http://alice:s3cr3tPW@127.0.0.1:8080/m/a.bin",
            "http://alice:***@127.0.0.1:8080/m/a.bin",
        ),
        ("https://TOKEN123@host/x", "https://***@host/x"),
        ("http://alice:s3cr3tPW@host", "http://alice:***@host"),
        ("http://:s3cr3tPW@host/", "http://***@host/"),
        ("s3://AKIAXX:secretkey@bucket/k", "s3://AKIAXX:***@bucket/k"),
        // An '@' in the password, and in the path (not userinfo).
        ("http://a:p@ss@host/x@y", "http://a:***@host/x@y"),
        ("https://host/org/model@v2/w.bin", "https://host/org/model@v2/w.bin"),
        (
            "https://host:8443/org/model@v2/w.bin",
            "https://host:8443/org/model@v2/w.bin",
        ),
        ("http://[::1]:8080/a@b", "http://[::1]:8080/a@b"),
        // Malformed: an unencoded '/' in the password.
        ("http://alice:pa/ss@host/x", "http://alice:***@host/x"),
        // Inside messages: quoted, in parentheses, twice.
        (
            "source http://alice:s3cr3tPW@127.0.0.1:1/m.yaml unavailable: error sending request for url (http://127.0.0.1:1/m.yaml)",
            "source http://alice:***@127.0.0.1:1/m.yaml unavailable: error sending request for url (http://127.0.0.1:1/m.yaml)",
        ),
        (
            "uri \"http://u:pw@h/\" and 'http://v:pw2@g/'",
            "uri \"http://u:***@h/\" and 'http://v:***@g/'",
        ),
        (
            "a http://u:one@h/ b http://w:two@g/ c",
            "a http://u:***@h/ b http://w:***@g/ c",
        ),
        // S3 presigned.
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Security-Token=FQoGZXIvYXdzEB&X-Amz-Signature=0123abcdef",
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Security-Token=***&X-Amz-Signature=***",
        ),
        // Lower-case names, first parameter.
        (
            "https://h/k?x-amz-signature=abc&b=1",
            "https://h/k?x-amz-signature=***&b=1",
        ),
        // Azure SAS.
        (
            "https://acct.blob.core.windows.net/c/b?sv=2022-11-02&ss=b&srt=o&sp=r&se=2026-12-31&sig=abc%2Bdef%2F%3D",
            "https://acct.blob.core.windows.net/c/b?sv=2022-11-02&ss=b&srt=o&sp=r&se=2026-12-31&sig=***",
        ),
        // Raw base64 with '/' and '+' in the value, then a fragment.
        ("https://a/c?sig=ab/c+d==#frag", "https://a/c?sig=***#frag"),
        // GCS signed URL.
        (
            "https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=sa%40p.iam.gserviceaccount.com%2F20260101&X-Goog-Signature=deadbeef00",
            "https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4-RSA-SHA256&X-Goog-Credential=***&X-Goog-Signature=***",
        ),
        // In parentheses (the HTTP client's message) the bracket stays.
        (
            "for url (http://h/k?sig=abc): refused",
            "for url (http://h/k?sig=***): refused",
        ),
        // HTML-escaped separator.
        ("https://h/k?a=1&amp;sig=abc", "https://h/k?a=1&amp;sig=***"),
        // Both kinds in one URI.
        (
            "http://u:pw@h/k?Signature=s&AWSAccessKeyId=AKIA",
            "http://u:***@h/k?Signature=***&AWSAccessKeyId=***",
        ),
        // Nothing to mask.
        ("https://h/k?sv=1&se=2", "https://h/k?sv=1&se=2"),
        ("no url at all: a@b c:d", "no url at all: a@b c:d"),
        ("file:///var/lib/models/a.bin", "file:///var/lib/models/a.bin"),
        ("", ""),
        ("://", "://"),
        ("://@", "://***@"),
        ("?sig=", "?sig=***"),
        ("http://", "http://"),
        ("http://@", "http://***@"),
        // Unicode around and inside.
        (
            "ürl http://ålice:pässwörd@hôst/ü?sig=ß✓ done",
            "ürl http://ålice:***@hôst/ü?sig=*** done",
        ),
        ("http://用户:密码@例子.测试/模型", "http://用户:***@例子.测试/模型"),
    ];

    #[test]
    fn every_kind_of_secret_is_masked() {
        for (input, want) in CASES {
            assert_eq!(redact(input), *want, "input {input:?}");
            // Idempotent: masking the masked text changes nothing.
            assert_eq!(redact(want), *want, "again on {want:?}");
        }
    }

    #[test]
    fn nothing_to_mask_borrows() {
        assert!(matches!(redact("https://h/k?sv=1"), Cow::Borrowed(_)));
        assert!(matches!(redact("http://u:***@h/"), Cow::Borrowed(_)));
    }

    #[test]
    fn secret_option_values_are_masked_as_typed_and_encoded() {
        let mut o = BTreeMap::new();
        o.insert(
            "aws_secret_access_key".to_string(),
            "wJalrXUtnFEMI/K7MDENG+bPxRfiCY".to_string(),
        );
        o.insert("AWS_ACCESS_KEY_ID".to_string(), "AKIAIOSFODNN7EXAMPLE".to_string());
        o.insert(
            "azure_storage_sas_key".to_string(),
            "sv=2022&sig=zzzzzzzzzz".to_string(),
        );
        o.insert("aws_region".to_string(), "eu-west-1-not-secret".to_string());
        o.insert("aws_session_token".to_string(), "short".to_string());
        register_source_options(&o);
        let text = "key AKIAIOSFODNN7EXAMPLE secret wJalrXUtnFEMI/K7MDENG+bPxRfiCY encoded \
                    wJalrXUtnFEMI%2FK7MDENG%2BbPxRfiCY sas sv=2022&sig=zzzzzzzzzz region eu-west-1-not-secret short";
        let got = redact(text);
        for secret in ["AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI", "zzzzzzzzzz"] {
            assert!(!got.contains(secret), "{secret} in {got}");
        }
        assert!(got.contains("eu-west-1-not-secret") && got.ends_with("short"), "{got}");
        assert!(is_secret_option("google_service_account_key") && is_secret_option("azure_client_secret"));
        assert!(!is_secret_option("aws_endpoint") && !is_secret_option("proxy_url"));
    }

    #[test]
    fn never_panics_on_any_input() {
        // Every prefix and suffix of adversarial strings (cuts inside multi-byte
        // characters are skipped by `get`), and a byte soup of the characters that matter.
        let samples = [
            "http://ü:ß@ĥ/?sig=✓&X-Amz-Signature=é#",
            "://@?&=sig=&&??==@@::",
            "\u{0}http://a:\u{7f}@b\u{1}?sig=\u{2028}",
        ];
        for s in samples {
            for i in 0..=s.len() {
                for part in [s.get(..i), s.get(i..)].into_iter().flatten() {
                    let _ = redact(part);
                }
            }
        }
        let alphabet = [":", "/", "@", "?", "&", "=", "sig", "://", "é", " ", "#", "[", "]", "("];
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..5000 {
            let mut s = String::new();
            for _ in 0..(x % 24) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                s.push_str(alphabet[(x % alphabet.len() as u64) as usize]);
            }
            let once = redact(&s).into_owned();
            assert_eq!(redact(&once), once, "idempotent on {s:?}");
        }
    }
}
