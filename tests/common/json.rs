//! JSON from loopd and the tools (`nbdinfo`, `fio`, `qemu-img`, `losetup`),
//! parsed by `serde_json`: [`Json`] is `serde_json::Value`, and [`JsonExt`]
//! adds the accessors the tests assert with. Each accessor panics with the
//! document when the value does not have the expected shape.
//!
//! A [`Json`] object's keys come back sorted (loopd builds `serde_json` without
//! `preserve_order`, and the tests must not turn that feature on for the binary
//! they test); [`OrderedObject`] keeps an object's entries in document order
//! for the tests that check field order.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

pub use serde_json::Value as Json;

/// The accessors tests use on a [`Json`] value.
pub trait JsonExt: Sized {
    /// Parses a whole document; panics (showing the text) if it is not JSON.
    fn parse(text: &str) -> Self;
    /// Parses the first JSON object in `text`, skipping any preamble lines
    /// (fio prints notes before its JSON).
    fn parse_first_object(text: &str) -> Self;
    /// `self[key]`, panicking with the document if it is missing.
    fn at(&self, key: &str) -> &Json;
    fn u64(&self) -> u64;
    fn i64(&self) -> i64;
    /// Any JSON number as `f64` (fio prints some as floats).
    fn f64(&self) -> f64;
    fn bool(&self) -> bool;
    fn str(&self) -> &str;
    fn arr(&self) -> &[Json];
}

impl JsonExt for Json {
    fn parse(text: &str) -> Json {
        serde_json::from_str(text).unwrap_or_else(|e| panic!("invalid JSON ({e}) in:\n{text}"))
    }

    fn parse_first_object(text: &str) -> Json {
        let start = text
            .find("\n{")
            .map(|i| i + 1)
            .or_else(|| text.starts_with('{').then_some(0))
            .unwrap_or_else(|| panic!("no JSON object in:\n{text}"));
        Json::parse(&text[start..])
    }

    fn at(&self, key: &str) -> &Json {
        self.get(key)
            .unwrap_or_else(|| panic!("JSON key {key:?} missing in {self}"))
    }

    fn u64(&self) -> u64 {
        self.as_u64()
            .unwrap_or_else(|| panic!("not an unsigned integer: {self}"))
    }

    fn i64(&self) -> i64 {
        self.as_i64()
            .unwrap_or_else(|| panic!("not an integer: {self}"))
    }

    fn f64(&self) -> f64 {
        self.as_f64()
            .unwrap_or_else(|| panic!("not a number: {self}"))
    }

    fn bool(&self) -> bool {
        self.as_bool()
            .unwrap_or_else(|| panic!("not a bool: {self}"))
    }

    fn str(&self) -> &str {
        self.as_str()
            .unwrap_or_else(|| panic!("not a string: {self}"))
    }

    fn arr(&self) -> &[Json] {
        self.as_array()
            .unwrap_or_else(|| panic!("not an array: {self}"))
    }
}

/// A JSON object with its entries in document order.
#[derive(Clone, Debug, PartialEq)]
pub struct OrderedObject(pub Vec<(String, Json)>);

impl OrderedObject {
    /// The keys, in document order.
    pub fn keys(&self) -> Vec<String> {
        self.0.iter().map(|(k, _)| k.clone()).collect()
    }

    /// The value of the first entry named `key`.
    pub fn get(&self, key: &str) -> Option<&Json> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl<'de> Deserialize<'de> for OrderedObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = OrderedObject;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<OrderedObject, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = m.next_entry::<String, Json>()? {
                    entries.push(entry);
                }
                Ok(OrderedObject(entries))
            }
        }
        d.deserialize_map(Entries)
    }
}
