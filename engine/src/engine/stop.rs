//! Stop strings over streamed text: text that could still be the start of a stop string is held
//! back until it can no longer match, so no part of a stop string ever reaches the client.

/// Holds back streamed text that might begin a stop string.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// A matcher for these stop strings (none: text passes straight through).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            held: String::new(),
        }
    }

    /// Adds new text. Returns the text now safe to emit and whether a stop string was found
    /// (in which case the text is cut just before it and nothing more should be emitted).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.held), false);
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        (out, false)
    }

    /// The text still held back (at the end of generation it is emitted as is).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_matches_and_cuts_at_the_stop() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), ("hello ".to_string(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("Dless"), (String::new(), true));
    }

    #[test]
    fn releases_text_that_stops_matching() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("a E"), ("a ".to_string(), false));
        assert_eq!(m.push("x\n"), ("Ex".to_string(), false));
        assert_eq!(m.flush(), "\n");
    }

    #[test]
    fn stop_spanning_many_pieces_and_earliest_wins() {
        let mut m = StopMatcher::new(vec!["cd".into(), "bcd".into()]);
        let mut out = String::new();
        let mut stopped = false;
        for piece in ["a", "b", "c", "d", "e"] {
            let (t, s) = m.push(piece);
            out.push_str(&t);
            if s {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(out, "a");
    }

    #[test]
    fn no_stops_passes_through() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("abc"), ("abc".to_string(), false));
    }
}
