//! Bounds for untrusted text before and after it is parsed: a linear pre-scan that
//! refuses YAML/JSON nested deeper than a limit (a parser given 100,000 levels took more
//! than 20 s before it refused them), and clipping of long values quoted back in error
//! messages (a 50 MB value must not be echoed to stderr, a Node condition or an Event).

use std::borrow::Cow;

/// Deepest nesting of collections accepted in a config, profile or manifest. Real ones
/// nest fewer than 12 levels; serde_yaml_ng's own recursion limit is 128.
pub const MAX_NESTING: usize = 64;

/// Longest run of non-blank bytes (a value, a key) quoted whole in a message.
pub const MAX_VALUE_BYTES: usize = 320;

/// Longest message, after its values are cut.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// Where a document first nests deeper than allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooDeep {
    /// 1-based line where the level past the limit opens.
    pub line: usize,
    /// The limit that was passed.
    pub limit: usize,
}

impl std::fmt::Display for TooDeep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "nested deeper than {} levels", self.limit)
    }
}

/// Check in one pass, without parsing, that `text` (YAML, or JSON which is YAML) nests no
/// deeper than `limit` collections. The count is of block levels (indentation and `- `
/// entries) plus open flow brackets outside quotes and comments; it may count a level
/// that a plain multi-line scalar only looks like, never fewer than the parser will build.
/// Time is linear in the text, memory bounded by `limit`.
pub fn check_nesting(text: &str, limit: usize) -> Result<(), TooDeep> {
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    let mut quote: Option<u8> = None;
    // Indentation of the line that opened a block scalar (`|`, `>`): more indented lines
    // (and blank ones) are its text, not structure.
    let mut block_scalar: Option<usize> = None;
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let b = line.as_bytes();
        let indent = b.iter().take_while(|&&c| c == b' ').count();
        let content = &b[indent..];
        if let Some(owner) = block_scalar {
            if content.is_empty() || indent > owner {
                continue;
            }
            block_scalar = None;
        }
        let mut pos = indent;
        if flow == 0 && quote.is_none() {
            if content.is_empty() || content[0] == b'#' {
                continue;
            }
            while indents.last().is_some_and(|&top| top >= indent) {
                indents.pop();
            }
            // A line that opens a flow collection is that collection's level (counted
            // at its bracket), not one more.
            if !matches!(content[0], b'[' | b'{') {
                indents.push(indent);
            }
            // Compact sequences: a `- ` followed by another `- ` opens a nested sequence
            // at that column; content that is a `key: value` opens a mapping there.
            let is_dash = |p: usize| p < b.len() && b[p] == b'-' && (p + 1 == b.len() || b[p + 1] == b' ');
            while is_dash(pos) {
                pos += 1;
                while pos < b.len() && b[pos] == b' ' {
                    pos += 1;
                }
                let rest = &b[pos..];
                if is_dash(pos) || rest.windows(2).any(|w| w == b": ") || rest.ends_with(b":") {
                    indents.push(pos);
                }
                if indents.len() > limit {
                    return Err(TooDeep { line: lineno, limit });
                }
            }
            if indents.len() > limit {
                return Err(TooDeep { line: lineno, limit });
            }
        }
        let mut last_token = pos;
        let mut last_open: Option<usize> = None;
        let mut j = pos;
        while j < b.len() {
            let c = b[j];
            match quote {
                Some(b'"') => {
                    if c == b'\\' {
                        j += 1;
                    } else if c == b'"' {
                        quote = None;
                    }
                }
                Some(_) => {
                    if c == b'\'' {
                        if b.get(j + 1) == Some(&b'\'') {
                            j += 1;
                        } else {
                            quote = None;
                        }
                    }
                }
                None => {
                    // An indicator opens structure only where a token starts: after a
                    // blank, after a bracket that itself opened structure, or after a flow
                    // separator inside a flow collection (`x[[` is a plain scalar).
                    let boundary = j == 0
                        || match b[j - 1] {
                            b' ' | b'\t' => true,
                            b'[' | b'{' => last_open == Some(j - 1),
                            b',' | b':' => flow > 0,
                            _ => false,
                        };
                    match c {
                        b'#' if j == 0 || matches!(b[j - 1], b' ' | b'\t') => break,
                        b'"' | b'\'' if boundary => quote = Some(c),
                        b'[' | b'{' if boundary => {
                            flow += 1;
                            last_open = Some(j);
                            if indents.len() + flow > limit {
                                return Err(TooDeep { line: lineno, limit });
                            }
                        }
                        b']' | b'}' if flow > 0 => flow -= 1,
                        _ => {}
                    }
                    if c != b' ' && c != b'\t' {
                        last_token = j;
                    }
                }
            }
            j += 1;
        }
        // `key: |`, `- >-`, `key: |2+`: the lines after belong to a block scalar.
        if flow == 0 && quote.is_none() {
            let mut k = (last_token + 1).min(b.len());
            while k > pos && matches!(b[k - 1], b'+' | b'-' | b'0'..=b'9') {
                k -= 1;
            }
            if k > pos && matches!(b[k - 1], b'|' | b'>') && (k - 1 == pos || b[k - 2] == b' ') {
                block_scalar = Some(indent);
            }
        }
    }
    Ok(())
}

/// `s` with every run of non-blank bytes longer than [`MAX_VALUE_BYTES`] cut to that
/// length plus `… (N bytes)`, and the whole cut to [`MAX_MESSAGE_BYTES`] the same way.
/// Borrowed when nothing was cut.
pub fn clip_message(s: &str) -> Cow<'_, str> {
    let longest_run = s.split(char::is_whitespace).map(str::len).max().unwrap_or(0);
    if longest_run <= MAX_VALUE_BYTES && s.len() <= MAX_MESSAGE_BYTES {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len().min(MAX_MESSAGE_BYTES + 64));
    let mut rest = s;
    while !rest.is_empty() {
        let run_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        out.push_str(&clip_value(&rest[..run_end]));
        rest = &rest[run_end..];
        let blank_end = rest.find(|c: char| !c.is_whitespace()).unwrap_or(rest.len());
        out.push_str(&rest[..blank_end]);
        rest = &rest[blank_end..];
        if out.len() > MAX_MESSAGE_BYTES {
            break;
        }
    }
    if out.len() > MAX_MESSAGE_BYTES {
        let total = out.len();
        let end = floor_char_boundary(&out, MAX_MESSAGE_BYTES);
        out.truncate(end);
        out.push_str(&format!("… ({total} bytes)"));
    }
    Cow::Owned(out)
}

/// `v` cut to [`MAX_VALUE_BYTES`] with a `… (N bytes)` marker when longer.
pub fn clip_value(v: &str) -> Cow<'_, str> {
    if v.len() <= MAX_VALUE_BYTES {
        return Cow::Borrowed(v);
    }
    let end = floor_char_boundary(v, MAX_VALUE_BYTES);
    Cow::Owned(format!("{}… ({} bytes)", &v[..end], v.len()))
}

/// Largest char boundary of `s` at or below `i`.
fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// `n` bytes for a message: `4 MiB` when a whole number of MiB, else the byte count.
pub fn human_bytes(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} MiB", n >> 20)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn depth_ok(text: &str, limit: usize) -> bool {
        check_nesting(text, limit).is_ok()
    }

    #[test]
    fn counts_block_and_flow_levels() {
        assert!(depth_ok("a:\n  b:\n    c: 1\n", 3));
        assert_eq!(
            check_nesting("a:\n  b:\n    c: 1\n", 2),
            Err(TooDeep { line: 3, limit: 2 })
        );
        assert!(depth_ok("a: [1, {b: 2}]\n", 3));
        assert_eq!(
            check_nesting("a: [1, {b: [2]}]\n", 3),
            Err(TooDeep { line: 1, limit: 3 })
        );
        // Compact sequences open a level per dash.
        assert!(depth_ok("- - - x\n", 3));
        assert!(!depth_ok("- - - - x\n", 3));
        // Brackets in quotes, comments and plain scalars are not structure.
        assert!(depth_ok("a: \"[[[[\" # [[[[\nb: '[[''[['\nc: x[[[[\n", 1));
        // A block scalar's text is not structure, however it is indented.
        assert!(depth_ok("a: |\n  x:\n    y:\n      z:\n        [[[\nb: 1\n", 1));
        // Indentation going back closes levels.
        assert!(depth_ok("a:\n  b: 1\nc:\n  d: 1\ne:\n  f: 1\n", 2));
        // JSON.
        assert!(depth_ok("{\"a\": [{\"b\": \"]]]\"}]}", 3));
        assert!(!depth_ok(
            &format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)),
            64
        ));
    }

    #[test]
    fn cuts_long_values_and_long_messages() {
        assert_eq!(clip_message("short message"), "short message");
        let long = "x".repeat(5000);
        let msg = format!("unknown field `{long}`, expected `a`");
        let m = clip_message(&msg);
        assert!(m.ends_with("… (5003 bytes) expected `a`"), "{m}");
        assert!(m.len() < 400, "{}", m.len());
        let words = "word ".repeat(1000);
        let m = clip_message(&words);
        assert!(m.len() < MAX_MESSAGE_BYTES + 32 && m.ends_with(" bytes)"), "{m}");
        // Never splits a character.
        let accents = "é".repeat(400);
        let m = clip_value(&accents);
        assert!(m.ends_with("… (800 bytes)"));
        assert_eq!(human_bytes(4 << 20), "4 MiB");
        assert_eq!(human_bytes(1000), "1000 bytes");
    }
}
