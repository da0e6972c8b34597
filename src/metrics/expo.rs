//! The Prometheus text exposition format, version 0.0.4: `# HELP` and `# TYPE`
//! once per family, then its samples, label values escaped.
//!
//! Written here rather than with `prometheus-client`: that crate encodes the
//! OpenMetrics format (`# EOF`, `_total` rules, `application/openmetrics-text`),
//! and its registry wants metric objects that own their values, where loopd's
//! values are atomics read at scrape time. Families are small and fixed, so a
//! dozen lines of formatting do.

use std::fmt::Write;

/// `counter`, `gauge`, `histogram`, `info`-style gauges are `gauge`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A text exposition being written.
#[derive(Default)]
pub struct Encoder {
    out: String,
}

impl Encoder {
    /// Start a family: its HELP and TYPE lines.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.name());
    }

    /// One sample of the current family.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", number(value));
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// Sample values: integers without a fraction, `+Inf`/`-Inf`/`NaN` as the
/// format spells them.
pub fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// Label values: backslash, double quote and newline escaped.
pub fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// HELP text: backslash and newline escaped.
pub fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_with_escaped_labels() {
        let mut e = Encoder::default();
        e.family("loopd_x_total", Kind::Counter, "Things.\nMore \\ text.");
        e.sample(
            "loopd_x_total",
            &[("device", "a\"b\\c\nd"), ("op", "read")],
            3.0,
        );
        e.sample("loopd_x_total", &[], 0.5);
        assert_eq!(
            e.finish(),
            "# HELP loopd_x_total Things.\\nMore \\\\ text.\n\
             # TYPE loopd_x_total counter\n\
             loopd_x_total{device=\"a\\\"b\\\\c\\nd\",op=\"read\"} 3\n\
             loopd_x_total 0.5\n"
        );
    }

    #[test]
    fn numbers() {
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(12345678.0), "12345678");
        assert_eq!(number(0.000001), "0.000001");
        assert_eq!(number(f64::NAN), "NaN");
    }
}
