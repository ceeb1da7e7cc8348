//! Shapes for reading JSON with serde's derive that the request parser (actors) and the model
//! file loaders (gpu) share.

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use std::fmt;
use std::marker::PhantomData;

/// A JSON object read as the struct `T`; anything else is refused. serde's derived structs
/// also accept a list of their fields in order: a request or a model file that has a list
/// where an object belongs is refused instead.
#[derive(Clone, Debug)]
pub struct Object<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = Object<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map)).map(Object)
            }
        }
        d.deserialize_map(ObjectVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::Object;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Two {
        a: u32,
        b: u32,
    }

    #[test]
    fn only_an_object_reads_as_a_struct() {
        let Object(t): Object<Two> = serde_json::from_str(r#"{"a": 1, "b": 2}"#).unwrap();
        assert_eq!(t, Two { a: 1, b: 2 });
        // A derived struct alone takes the list; `Object` refuses it.
        assert!(serde_json::from_str::<Two>("[1, 2]").is_ok());
        let err = serde_json::from_str::<Object<Two>>("[1, 2]").unwrap_err();
        assert!(err.to_string().contains("a JSON object"), "{err}");
    }
}
