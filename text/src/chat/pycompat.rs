//! Python compatibility for chat templates: the string and dict methods, `strftime_now` and
//! `tojson` that Hugging Face chat templates rely on, with Python's semantics.

use std::io;

use minijinja::value::{from_args, Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

/// Python methods on strings (`strip`, `split`, `startswith`, ...) and dicts (`items`, `get`,
/// ...); anything else is an unknown method.
pub(super) fn call_method(
    _state: &State,
    value: &Value,
    name: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        return str_method(s, name, args);
    }
    if value.kind() == ValueKind::Map {
        return map_method(value, name, args);
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

fn str_method(s: &str, name: &str, args: &[Value]) -> Result<Value, Error> {
    let strip_set = |args: &[Value]| -> Result<Option<Vec<char>>, Error> {
        let (chars,): (Option<&str>,) = from_args(args)?;
        Ok(chars.map(|c| c.chars().collect()))
    };
    Ok(match name {
        "strip" | "lstrip" | "rstrip" => {
            let set = strip_set(args)?;
            let pred = |c: char| match &set {
                Some(set) => set.contains(&c),
                None => c.is_whitespace(),
            };
            Value::from(match name {
                "strip" => s.trim_matches(pred),
                "lstrip" => s.trim_start_matches(pred),
                _ => s.trim_end_matches(pred),
            })
        }
        "startswith" | "endswith" => {
            let (affix,): (Value,) = from_args(args)?;
            let test = |a: &str| {
                if name == "startswith" {
                    s.starts_with(a)
                } else {
                    s.ends_with(a)
                }
            };
            let hit = match affix.as_str() {
                Some(a) => test(a),
                None => affix.try_iter()?.any(|v| v.as_str().is_some_and(test)),
            };
            Value::from(hit)
        }
        "split" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let limit = maxsplit
                .filter(|&m| m >= 0)
                .map(|m| usize::try_from(m).unwrap_or(usize::MAX).saturating_add(1));
            let parts: Vec<Value> = match (sep, limit) {
                (Some(""), _) => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"))
                }
                (Some(sep), Some(n)) => s.splitn(n, sep).map(Value::from).collect(),
                (Some(sep), None) => s.split(sep).map(Value::from).collect(),
                (None, limit) => split_whitespace(s, limit),
            };
            Value::from(parts)
        }
        "splitlines" => {
            let () = from_args(args)?;
            Value::from(s.lines().map(Value::from).collect::<Vec<_>>())
        }
        "upper" | "lower" | "title" | "capitalize" => {
            let () = from_args(args)?;
            Value::from(match name {
                "upper" => s.to_uppercase(),
                "lower" => s.to_lowercase(),
                "title" => title_case(s),
                _ => {
                    let mut chars = s.chars();
                    match chars.next() {
                        Some(first) => first
                            .to_uppercase()
                            .chain(chars.flat_map(char::to_lowercase))
                            .collect(),
                        None => String::new(),
                    }
                }
            })
        }
        "replace" => {
            let (old, new, count): (&str, &str, Option<i64>) = from_args(args)?;
            Value::from(match count.filter(|&c| c >= 0) {
                Some(c) => s.replacen(old, new, usize::try_from(c).unwrap_or(usize::MAX)),
                None => s.replace(old, new),
            })
        }
        "find" => {
            let (sub,): (&str,) = from_args(args)?;
            Value::from(match s.find(sub) {
                Some(byte) => s[..byte].chars().count() as i64,
                None => -1,
            })
        }
        "count" => {
            let (sub,): (&str,) = from_args(args)?;
            Value::from(if sub.is_empty() {
                s.chars().count() + 1
            } else {
                s.matches(sub).count()
            })
        }
        "join" => {
            let (items,): (Value,) = from_args(args)?;
            let parts: Vec<String> = items.try_iter()?.map(|v| v.to_string()).collect();
            Value::from(parts.join(s))
        }
        "isdigit" | "isalpha" | "isalnum" | "isspace" | "islower" | "isupper" => {
            let () = from_args(args)?;
            let all = |f: fn(&char) -> bool| !s.is_empty() && s.chars().all(|c| f(&c));
            Value::from(match name {
                "isdigit" => all(|c| c.is_numeric()),
                "isalpha" => all(|c| c.is_alphabetic()),
                "isalnum" => all(|c| c.is_alphanumeric()),
                "isspace" => all(|c| c.is_whitespace()),
                "islower" => {
                    s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase)
                }
                _ => s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase),
            })
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

/// Python's `str.split()` without a separator: runs of whitespace separate, ends are ignored.
fn split_whitespace(s: &str, limit: Option<usize>) -> Vec<Value> {
    let mut out = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        if limit.is_some_and(|n| out.len() + 1 >= n) {
            out.push(Value::from(rest));
            break;
        }
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        out.push(Value::from(&rest[..end]));
        rest = rest[end..].trim_start();
    }
    out
}

/// Python's `str.title()`: uppercase after any non-letter, lowercase after a letter.
fn title_case(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_letter = false;
    for c in s.chars() {
        if prev_letter {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_letter = c.is_alphabetic();
    }
    out
}

fn map_method(map: &Value, name: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match name {
        "items" | "keys" | "values" => {
            let () = from_args(args)?;
            let mut out = Vec::new();
            for key in map.try_iter()? {
                let v = map.get_item(&key)?;
                out.push(match name {
                    "items" => Value::from(vec![key, v]),
                    "keys" => key,
                    _ => v,
                });
            }
            Value::from(out)
        }
        "get" => {
            let (key, default): (Value, Option<Value>) = from_args(args)?;
            let v = map.get_item(&key)?;
            if v.is_undefined() {
                default.unwrap_or(Value::from(()))
            } else {
                v
            }
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

/// `strftime_now(format)`: the current UTC time formatted with the common `strftime` codes.
pub(super) fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(format_time(secs, &format)))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// Year, month (1-12) and day (1-31) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_date(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of each 400-year cycle.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Formats `secs` since the Unix epoch (UTC) with `strftime` codes.
fn format_time(secs: i64, format: &str) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_date(days);
    let (h, m, s) = (tod / 3600, tod / 60 % 60, tod % 60);
    let weekday = (days + 4).rem_euclid(7) as usize;
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day + u32::from(leap && month > 2);
    let month_name = MONTHS[month as usize - 1];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some(other) => {
                    out.push_str("%-");
                    out.push(other);
                }
                None => out.push_str("%-"),
            },
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", (h + 11) % 12 + 1)),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as Hugging Face defines it: Python's `json.dumps` with `ensure_ascii=False`
/// (separators `", "` and `": "`, or newlines and `indent` spaces when `indent` is given).
pub(super) fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    // Accept (and ignore) the other json.dumps options templates sometimes pass.
    for key in ["ensure_ascii", "sort_keys", "separators"] {
        let _: Option<Value> = kwargs.get(key)?;
    }
    let mut buf = Vec::new();
    let result = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            serde::Serialize::serialize(
                value,
                &mut serde_json::Serializer::with_formatter(&mut buf, fmt),
            )
        }
        None => serde::Serialize::serialize(
            value,
            &mut serde_json::Serializer::with_formatter(&mut buf, PyFormatter),
        ),
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let s = String::from_utf8(buf)
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson produced invalid utf-8"))?;
    Ok(Value::from(s))
}

/// Python's item separator, written before every item but the first.
fn separator<W: ?Sized + io::Write>(w: &mut W, first: bool) -> io::Result<()> {
    if first {
        Ok(())
    } else {
        w.write_all(b", ")
    }
}

/// serde_json formatter with Python's default separators.
struct PyFormatter;

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        separator(w, first)
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        separator(w, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// Jinja2's `is iterable`: Python's `iter()` succeeds. `None`, booleans and numbers are not
/// iterable; strings, lists, dicts and Jinja2's `Undefined` are. (minijinja's own test also
/// counts `none`, which makes `tools is iterable and tools | length > 0` fail without tools.)
pub(super) fn is_iterable(value: &Value) -> bool {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Invalid => false,
        ValueKind::Undefined | ValueKind::String | ValueKind::Bytes => true,
        _ => value.try_iter().is_ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(
            format_time(0, "%Y-%m-%d %H:%M:%S %A %j"),
            "1970-01-01 00:00:00 Thursday 001"
        );
        // 2024-02-29 12:34:56 UTC, a leap day.
        assert_eq!(
            format_time(1_709_210_096, "%d %B %Y, %a %b %-d %I%p %j %y"),
            "29 February 2024, Thu Feb 29 12PM 060 24"
        );
        assert_eq!(format_time(951_782_400, "%Y-%m-%d"), "2000-02-29");
        assert_eq!(format_time(-86_400, "%Y-%m-%d"), "1969-12-31");
        assert_eq!(format_time(0, "100%% %q"), "100% %q");
    }
}
