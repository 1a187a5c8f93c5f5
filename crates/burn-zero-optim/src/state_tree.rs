//! Optimizer state, taken apart and put back together through its Burn record.
//!
//! An optimizer's state type may keep its tensors private (Burn's `MomentumState`), but every
//! state is a Burn `Record`, and a record's item is serde data in which each tensor appears as
//! a map with `bytes`, `shape` and `dtype`. The state is serialised to a CBOR value tree in
//! which every tensor with one element per element of the master copy can be cut apart or
//! joined, while the rest — the skeleton, with scalars such as Adam's step count — stays as it
//! is. The optimizer splits a chunk's flat state into its parameters' states this way (and
//! joins them back); checkpoints cut each parameter's state into pieces per rank, keep the
//! skeleton as JSON, and put the bytes cut for the loading rank back into it.

use burn::record::{FullPrecisionSettings, Record};
use burn::tensor::backend::Backend;
use ciborium::Value;

/// The serde item of a record in full precision.
pub type Item<H, R> = <R as Record<H>>::Item<FullPrecisionSettings>;

/// The state as a value tree.
pub fn to_tree<H: Backend, R: Record<H>>(state: R) -> Result<Value, String> {
    let item: Item<H, R> = state.into_item::<FullPrecisionSettings>();
    Value::serialized(&item).map_err(|e| format!("cannot serialise the record: {e}"))
}

/// The state back from a value tree.
pub fn from_tree<H: Backend, R: Record<H>>(tree: Value, device: &H::Device) -> Result<R, String> {
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
pub struct TensorLeaf<'a> {
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
pub fn for_each_tensor(tree: &mut Value, f: &mut dyn FnMut(TensorLeaf<'_>)) {
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
pub fn tree_to_json(tree: &Value) -> Result<serde_json::Value, String> {
    serde_json::to_value(tree).map_err(|e| format!("cannot store the state's skeleton: {e}"))
}

/// The tree back from JSON; placeholders' bytes come back as arrays and are replaced.
pub fn tree_from_json(json: &serde_json::Value) -> Result<Value, String> {
    Value::serialized(json).map_err(|e| format!("cannot read the state's skeleton: {e}"))
}

/// The state of a flat master of `len` elements, split into the states of the consecutive
/// parts `parts` (lengths adding up to `len`): every tensor with `len` elements is cut, the
/// rest copied into each part.
pub fn split_state<H: Backend, R: Record<H>>(
    state: R,
    len: usize,
    parts: &[usize],
    device: &H::Device,
) -> Result<Vec<R>, String> {
    let mut tree = to_tree::<H, R>(state)?;
    // Each flat tensor's bytes, by field, taken out of the skeleton once.
    let mut flat: Vec<(String, Vec<u8>)> = Vec::new();
    for_each_tensor(&mut tree, &mut |mut leaf| {
        if leaf.shape == [len] {
            flat.push((leaf.field.clone(), leaf.take_bytes()));
        }
    });
    let mut start = 0;
    let mut states = Vec::with_capacity(parts.len());
    for &part in parts {
        let mut piece = tree.clone();
        let mut missing = None;
        for_each_tensor(&mut piece, &mut |mut leaf| {
            if leaf.shape != [len] {
                return;
            }
            match flat.iter().find(|(field, _)| *field == leaf.field) {
                Some((_, bytes)) => {
                    let size = bytes.len() / len.max(1);
                    leaf.put(bytes[start * size..(start + part) * size].to_vec(), part);
                }
                None => missing = Some(leaf.field.clone()),
            }
        });
        if let Some(field) = missing {
            return Err(format!(
                "the state's tensor `{field}` was not found to split"
            ));
        }
        states.push(from_tree::<H, R>(piece, device)?);
        start += part;
    }
    Ok(states)
}

/// The states of consecutive parts (each with its length), joined into the state of their
/// flat concatenation: every tensor with one element per element of its part is joined in
/// order; the rest is taken from the first part, and must be the same in every part.
pub fn join_states<H: Backend, R: Record<H>>(
    parts: Vec<(R, usize)>,
    device: &H::Device,
) -> Result<R, String> {
    let mut trees = Vec::with_capacity(parts.len());
    for (state, len) in parts {
        let mut tree = to_tree::<H, R>(state)?;
        let mut flat: Vec<(String, Vec<u8>)> = Vec::new();
        for_each_tensor(&mut tree, &mut |mut leaf| {
            if leaf.shape == [len] {
                flat.push((leaf.field.clone(), leaf.take_bytes()));
                // What is left must read alike in every part.
                leaf.put(Vec::new(), 0);
            }
        });
        trees.push((tree, len, flat));
    }
    let Some((first, _, _)) = trees.first() else {
        return Err("no state to join".into());
    };
    if trees.iter().any(|(tree, _, _)| tree != first) {
        return Err(
            "the parts' states differ in more than their per-element tensors (a step count?), \
             so they cannot form one state"
                .into(),
        );
    }
    let total: usize = trees.iter().map(|(_, len, _)| len).sum();
    let fields: Vec<String> = trees[0].2.iter().map(|(field, _)| field.clone()).collect();
    let mut joined: Vec<(String, Vec<u8>)> = Vec::with_capacity(fields.len());
    for field in fields {
        let mut bytes = Vec::new();
        for (_, _, flat) in &trees {
            match flat.iter().find(|(f, _)| *f == field) {
                Some((_, part)) => bytes.extend_from_slice(part),
                None => return Err(format!("a part's state has no tensor `{field}`")),
            }
        }
        joined.push((field, bytes));
    }
    let mut tree = trees.swap_remove(0).0;
    for_each_tensor(&mut tree, &mut |mut leaf| {
        if let Some((_, bytes)) = joined.iter().find(|(field, _)| *field == leaf.field) {
            leaf.put(bytes.clone(), total);
        }
    });
    from_tree::<H, R>(tree, device)
}
