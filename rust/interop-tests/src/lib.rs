//! Nothing here: the crate exists for `tests/dynamo_router.rs`, which checks pagedkv's KV-event
//! bytes against NVIDIA Dynamo's KV router (`dynamo-kv-router` from crates.io).
