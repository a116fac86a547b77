//! The one duration grammar of every cleave flag and `CLEAVE_*` variable: a non-negative number
//! with an optional unit, `ms`, `s`, `m` or `h` (`250ms`, `1.5s`, `2m`, `1h`); a plain number
//! is seconds (`30`).

use std::time::Duration;

/// Why a duration did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a number followed by an optional unit.
    #[error("invalid duration {0:?} (expected a number with ms, s, m or h, e.g. 250ms or 30s)")]
    Syntax(String),
    /// A unit other than ms, s, m, h.
    #[error("invalid duration unit in {0:?} (use ms, s, m or h)")]
    Unit(String),
    /// Negative, or too large to represent.
    #[error("duration {0:?} is out of range")]
    Range(String),
    /// Zero where a wait or period must be positive.
    #[error("duration {0:?} must be greater than zero")]
    Zero(String),
}

/// Parses `250ms`, `30s`, `2m`, `1h` or a plain number of seconds; zero is allowed.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| DurationError::Syntax(s.to_string()))?;
    let scale = match unit {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(DurationError::Unit(s.to_string())),
    };
    Duration::try_from_secs_f64(n * scale).map_err(|_| DurationError::Range(s.to_string()))
}

/// [`parse_duration`], refusing zero (for timeouts and periods).
pub fn parse_positive_duration(s: &str) -> Result<Duration, DurationError> {
    match parse_duration(s)? {
        d if d.is_zero() => Err(DurationError::Zero(s.to_string())),
        d => Ok(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_and_plain_seconds() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration(" 10s "), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    }

    #[test]
    fn bad_input_says_what_is_wrong() {
        assert!(matches!(parse_duration("3d"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration("s"), Err(DurationError::Syntax(_))));
        assert!(matches!(parse_duration(""), Err(DurationError::Syntax(_))));
        assert!(matches!(
            parse_duration("-1s"),
            Err(DurationError::Range(_))
        ));
        assert!(matches!(
            parse_duration("99999999999999999999999h"),
            Err(DurationError::Range(_))
        ));
        assert!(parse_duration("NaN").is_err());
        assert!(matches!(
            parse_positive_duration("0ms"),
            Err(DurationError::Zero(_))
        ));
        assert_eq!(parse_positive_duration("1"), Ok(Duration::from_secs(1)));
        let msg = parse_duration("3d").unwrap_err().to_string();
        assert!(msg.contains("3d") && msg.contains("ms, s, m or h"), "{msg}");
    }
}
