//! Why the coordinator refused a call, as a value a peer can match on: a
//! gRPC status carries it in its metadata (key [`REASON_KEY`]) beside the
//! human message, so a worker never has to read the message text to know
//! what happened.

use tonic::Status;
use tonic::metadata::MetadataValue;

/// The status metadata key that names a [`Refusal`].
pub const REASON_KEY: &str = "stoke-reason";

/// A refusal a worker acts on differently from the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The session is unknown to the coordinator (it restarted, or the
    /// session timed out): register again.
    UnknownSession,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownSession => "unknown-session",
        }
    }

    /// Marks `status` as this refusal.
    pub fn attach(self, status: &mut Status) {
        status
            .metadata_mut()
            .insert(REASON_KEY, MetadataValue::from_static(self.as_str()));
    }

    /// The refusal `status` is marked with, if any.
    pub fn of(status: &Status) -> Option<Self> {
        let reason = status.metadata().get(REASON_KEY)?.to_str().ok()?;
        [Self::UnknownSession]
            .into_iter()
            .find(|r| r.as_str() == reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_travels_in_the_status_metadata() {
        let mut status = Status::not_found("unknown session s1; register again");
        assert_eq!(Refusal::of(&status), None);
        Refusal::UnknownSession.attach(&mut status);
        assert_eq!(Refusal::of(&status), Some(Refusal::UnknownSession));
        // Through the wire form (headers) too.
        let response = status.clone().into_http::<()>();
        let again = Status::from_header_map(response.headers()).expect("a status");
        assert_eq!(Refusal::of(&again), Some(Refusal::UnknownSession));
        // The message alone says nothing.
        let text_only = Status::not_found("unknown session s1; register again");
        assert_eq!(Refusal::of(&text_only), None);
    }
}
