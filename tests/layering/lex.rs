//! Rust source → tokens, without comments and with literals reduced to one
//! token; and the lines of code of a file.

use std::collections::BTreeSet;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
    /// A string, byte string, raw string or char literal.
    Lit,
}

/// One token and the lines it spans (1-based, inclusive).
#[derive(Debug, Clone)]
pub struct Token {
    pub tok: Tok,
    pub line: usize,
    pub end_line: usize,
}

/// Rust source → tokens, without comments (line, block, nested block, doc)
/// and with literals reduced to [`Tok::Lit`]; numbers become identifiers
/// (harmless: no rule looks at them).
pub fn lex(src: &str) -> Vec<Token> {
    let b = src.as_bytes();
    let n = b.len();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80;
    let count_lines = |from: usize, to: usize| b[from..to].iter().filter(|&&c| c == b'\n').count();
    while i < n {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c.is_ascii_whitespace() {
            i += 1;
        } else if b[i..].starts_with(b"//") {
            while i < n && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let start = i;
            let mut depth = 0;
            while i < n {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            line += count_lines(start, i);
        } else if let Some(end) = raw_string_end(b, i) {
            let start_line = line;
            line += count_lines(i, end);
            out.push(Token {
                tok: Tok::Lit,
                line: start_line,
                end_line: line,
            });
            i = end;
        } else if c == b'"' || (c == b'b' && b.get(i + 1) == Some(&b'"')) {
            let start = i;
            i += if c == b'b' { 2 } else { 1 };
            while i < n && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(n);
            let start_line = line;
            line += count_lines(start, i);
            out.push(Token {
                tok: Tok::Lit,
                line: start_line,
                end_line: line,
            });
        } else if c == b'\'' || (c == b'b' && b.get(i + 1) == Some(&b'\'')) {
            // A char literal ('x', '\n', '\u{1F600}', b'x') or a lifetime ('a).
            let q = if c == b'b' { i + 1 } else { i };
            let body = q + 1;
            let lit_end = if b.get(body) == Some(&b'\\') {
                // An escape: up to the next quote after the escaped character.
                let mut j = body + 2;
                while j < n && b[j] != b'\'' {
                    j += 1;
                }
                Some(j + 1)
            } else {
                // One (possibly multi-byte) character, then a quote.
                let ch_len = src[body.min(n)..].chars().next().map_or(0, char::len_utf8);
                (b.get(body + ch_len) == Some(&b'\'')).then_some(body + ch_len + 1)
            };
            match lit_end {
                Some(e) => {
                    out.push(Token {
                        tok: Tok::Lit,
                        line,
                        end_line: line,
                    });
                    i = e;
                }
                None => {
                    // A lifetime or label: skip the quote and its name.
                    i = body;
                    while i < n && ident(b[i]) {
                        i += 1;
                    }
                }
            }
        } else if ident(c) {
            let start = i;
            while i < n && ident(b[i]) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(src[start..i].to_string()),
                line,
                end_line: line,
            });
        } else if b[i..].starts_with(b"::") {
            out.push(Token {
                tok: Tok::Sep,
                line,
                end_line: line,
            });
            i += 2;
        } else {
            let ch = src[i..].chars().next().unwrap_or('?');
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
                end_line: line,
            });
            i += ch.len_utf8();
        }
    }
    out
}

/// Where a raw (byte) string starting at `i` ends: `r"…"`, `r#"…"#`, `br##"…"##`.
pub fn raw_string_end(b: &[u8], i: usize) -> Option<usize> {
    if i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_') {
        return None;
    }
    let mut j = i;
    if b.get(j) == Some(&b'b') {
        j += 1;
    }
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
    j += hashes;
    if b.get(j) != Some(&b'"') {
        return None;
    }
    j += 1;
    let mut close = vec![b'"'];
    close.extend(std::iter::repeat_n(b'#', hashes));
    let at = b[j..]
        .windows(close.len())
        .position(|w| w == close.as_slice())?;
    Some(j + at + close.len())
}

/// Lines holding code: anything but whitespace and comments.
pub fn code_lines(src: &str) -> usize {
    let mut lines = BTreeSet::new();
    for t in lex(src) {
        lines.extend(t.line..=t.end_line);
    }
    lines.len()
}
