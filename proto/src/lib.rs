//! The wire protocol between stoke's clients, coordinator and workers.
//!
//! Holds only the `stoke.v1` protobuf package (`proto/stoke.proto`) and the
//! tonic/prost code generated from it. Conversions to domain types live with
//! the domain types (`stoke-core`'s `conv` module), not here.

#![allow(clippy::all, missing_docs)]

/// The `stoke.v1` package.
pub mod v1 {
    tonic::include_proto!("stoke.v1");
}
