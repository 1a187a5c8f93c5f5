//! [`establish()`]: a rank's control connection set up through the TCP rendezvous, which
//! carries the store's port to the other ranks along with rank 0's blob.

use std::time::Duration;

use super::client::ControlClient;
use super::error::ControlError;
use super::first_cause::cause_file_from_env;
use super::server::ControlServer;
use crate::env::DistEnv;
use crate::rendezvous::{Rendezvous, RendezvousListener};

/// Sets up a rank's control connection and shares `make_blob`'s bytes (rank 0's) with every
/// rank through the rendezvous of `env`: rank 0 starts the store on a port the system picks
/// and sends that port along with the blob; every rank then connects to the store. Returns
/// the blob and the connection. A job of one rank needs no network.
///
/// Rank 0's store writes the job's first cause to the file named by
/// [`CAUSE_FILE_VAR`](super::first_cause::CAUSE_FILE_VAR) when this process's environment sets
/// it (`zero-run` does).
///
/// `listener` is rank 0's rendezvous socket when it was bound beforehand (to learn a port
/// the system picked); otherwise rank 0 binds `MASTER_PORT`.
pub fn establish(
    env: &DistEnv,
    timeout: Duration,
    listener: Option<RendezvousListener>,
    make_blob: impl FnOnce() -> Vec<u8>,
) -> Result<(Vec<u8>, ControlClient), ControlError> {
    if env.world_size == 1 {
        return Ok((make_blob(), ControlClient::solo()));
    }
    let rendezvous = Rendezvous::new(env).with_timeout(timeout);
    if env.rank == 0 {
        let server = ControlServer::start_with_cause_file(
            &env.master_addr,
            env.world_size,
            cause_file_from_env(),
        )?;
        let blob = make_blob();
        let mut shared = blob.clone();
        shared.extend_from_slice(&server.port().to_be_bytes());
        match listener {
            Some(listener) => rendezvous.serve_on(listener, &shared)?,
            None => rendezvous.serve(&shared)?,
        }
        let client =
            ControlClient::connect(&env.master_addr, server.port(), 0, env.world_size, timeout)?;
        Ok((blob, client.hosting(server)))
    } else {
        let mut shared = rendezvous.fetch()?;
        if shared.len() < 2 {
            return Err(ControlError::Connection {
                endpoint: env.master_endpoint(),
                reason: "rank 0 sent no store port".into(),
            });
        }
        let port_bytes = shared.split_off(shared.len() - 2);
        let port = u16::from_be_bytes([port_bytes[0], port_bytes[1]]);
        let client =
            ControlClient::connect(&env.master_addr, port, env.rank, env.world_size, timeout)?;
        Ok((shared, client))
    }
}
