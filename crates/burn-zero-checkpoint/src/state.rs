//! Optimizer state, taken apart and put back together through its Burn record.
//!
//! An optimizer's state type may keep its tensors private (Burn's `MomentumState`), but every
//! state is a Burn `Record`, and a record's item is serde data in which each tensor appears as
//! a map with `bytes`, `shape` and `dtype`. The state is serialised to a CBOR value tree; every
//! tensor with one element per element of the master copy is cut out (its bytes saved in
//! pieces like the master's), and what is left — the skeleton, with scalars such as Adam's step
//! count — is kept as JSON. Loading puts the bytes, cut for the loading rank, back into the
//! skeleton and deserialises the item.

use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::Backend;
use ciborium::Value;

/// The serde item of a record in full precision.
pub(crate) type Item<H, R> = <R as Record<H>>::Item<FullPrecisionSettings>;

/// The state as a value tree.
pub(crate) fn to_tree<H: Backend, R: Record<H>>(state: R) -> Result<Value, String> {
    let item: Item<H, R> = state.into_item::<FullPrecisionSettings>();
    Value::serialized(&item).map_err(|e| format!("cannot serialise the record: {e}"))
}

/// The state back from a value tree.
pub(crate) fn from_tree<H: Backend, R: Record<H>>(
    tree: Value,
    device: &H::Device,
) -> Result<R, String> {
    let item: Item<H, R> = tree
        .deserialized()
        .map_err(|e| format!("cannot rebuild the record: {e}"))?;
    Ok(R::from_item::<FullPrecisionSettings>(item, device))
}

fn entry<'a>(map: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    map.iter()
        .find(|(k, _)| k.as_text() == Some(key))
        .map(|(_, v)| v)
}

fn entry_mut<'a>(map: &'a mut [(Value, Value)], key: &str) -> Option<&'a mut Value> {
    map.iter_mut()
        .find(|(k, _)| k.as_text() == Some(key))
        .map(|(_, v)| v)
}

/// A tensor inside the tree: its shape and dtype name (`"F32"`).
pub(crate) struct TensorLeaf<'a> {
    pub field: String,
    pub shape: Vec<usize>,
    pub dtype: String,
    map: &'a mut Vec<(Value, Value)>,
}

impl TensorLeaf<'_> {
    /// Takes the tensor's bytes out, leaving an empty placeholder.
    pub fn take_bytes(&mut self) -> Vec<u8> {
        match entry_mut(self.map, "bytes") {
            Some(value) => match std::mem::replace(value, Value::Bytes(Vec::new())) {
                Value::Bytes(bytes) => bytes,
                other => {
                    *value = other;
                    Vec::new()
                }
            },
            None => Vec::new(),
        }
    }

    /// Puts bytes of `len` elements in.
    pub fn put(&mut self, bytes: Vec<u8>, len: usize) {
        if let Some(value) = entry_mut(self.map, "bytes") {
            *value = Value::Bytes(bytes);
        }
        if let Some(value) = entry_mut(self.map, "shape") {
            *value = Value::Array(vec![Value::Integer(len.into())]);
        }
    }
}

fn as_tensor(map: &[(Value, Value)]) -> Option<(Vec<usize>, String)> {
    entry(map, "bytes")?;
    let shape = entry(map, "shape")?.as_array()?;
    let dtype = entry(map, "dtype")?.as_text()?.to_string();
    let shape = shape
        .iter()
        .map(|d| {
            d.as_integer()
                .and_then(|i| usize::try_from(i128::from(i)).ok())
        })
        .collect::<Option<Vec<_>>>()?;
    Some((shape, dtype))
}

/// Calls `f` on every tensor of the tree, with its field path (`momentum.moment_1`).
pub(crate) fn for_each_tensor(tree: &mut Value, f: &mut dyn FnMut(TensorLeaf<'_>)) {
    fn walk(value: &mut Value, path: &mut Vec<String>, f: &mut dyn FnMut(TensorLeaf<'_>)) {
        match value {
            Value::Map(map) => {
                if let Some((shape, dtype)) = as_tensor(map) {
                    f(TensorLeaf {
                        field: path.join("."),
                        shape,
                        dtype,
                        map,
                    });
                    return;
                }
                for (key, child) in map.iter_mut() {
                    let key = match key {
                        Value::Text(text) => text.clone(),
                        Value::Integer(i) => i128::from(*i).to_string(),
                        _ => "?".to_string(),
                    };
                    path.push(key);
                    walk(child, path, f);
                    path.pop();
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter_mut().enumerate() {
                    path.push(i.to_string());
                    walk(child, path, f);
                    path.pop();
                }
            }
            Value::Tag(_, inner) => walk(inner, path, f),
            _ => {}
        }
    }
    walk(tree, &mut Vec::new(), f);
}

/// The tree as JSON (the skeleton kept in `metadata.json`).
pub(crate) fn tree_to_json(tree: &Value) -> Result<serde_json::Value, String> {
    serde_json::to_value(tree).map_err(|e| format!("cannot store the state's skeleton: {e}"))
}

/// The tree back from JSON; placeholders' bytes come back as arrays and are replaced.
pub(crate) fn tree_from_json(json: &serde_json::Value) -> Result<Value, String> {
    Value::serialized(json).map_err(|e| format!("cannot read the state's skeleton: {e}"))
}
