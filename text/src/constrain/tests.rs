use super::*;

#[test]
fn schemas_get_the_compact_layout_unless_they_choose_their_own() {
    let s = with_layout(&serde_json::json!({"type": "object"})).unwrap();
    assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
    let own = serde_json::json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
    assert_eq!(with_layout(&own).unwrap(), own);
    assert!(with_layout(&serde_json::json!(true)).is_ok());
    assert!(with_layout(&serde_json::json!("object")).is_err());
}

#[test]
fn choices_are_quoted_as_lark_literals() {
    assert_eq!(lark_literal("a \"b\"\n"), r#""a \"b\"\n""#);
    assert!(Constraint::Choice { choices: vec![] }.grammar().is_err());
}

#[test]
fn constraints_read_as_tagged_json() {
    let c: Constraint = serde_json::from_str(r#"{"type": "regex", "pattern": "[a-z]+"}"#).unwrap();
    assert_eq!(
        c,
        Constraint::Regex {
            pattern: "[a-z]+".into()
        }
    );
    assert!(serde_json::from_str::<Constraint>(r#"{"type": "xml"}"#).is_err());
}
