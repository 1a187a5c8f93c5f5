//! How a rank's process comes to its place in the job's MPI world, with the job's control
//! connection beside it.
//!
//! - An MPI launcher (`mpirun`, or `srun` with Slurm's MPI support) started every rank as one
//!   MPI job: `MPI_COMM_WORLD` holds them, numbered by MPI. Rank 0 starts the job's control
//!   store and broadcasts its port and host over MPI; nothing else is needed (no master
//!   address or port).
//! - Another launcher (`zero-run`) started the ranks as separate programs, each its own MPI job
//!   of one (a singleton). The ranks meet at the launcher's TCP rendezvous, which starts the
//!   control store and hands every rank the name of an MPI port rank 0 opened; the others
//!   connect one by one, every rank already joined taking part in each accept
//!   (`MPI_Comm_accept`, `MPI_Comm_connect`, `MPI_Intercomm_merge`), and a final split orders
//!   the joined world by the launcher's ranks. Open MPI lets separate jobs connect only through
//!   its name server, `ompi-server`, which every process finds through
//!   `OMPI_MCA_pmix_server_uri`: `zero-run` starts one for its ranks and sets the variable.

use std::ffi::CString;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn_zero_launch::name_server::SERVER_URI_VAR;
use burn_zero_launch::{ControlClient, DistEnv, establish};

use super::MpiOptions;
use super::group::{MpiGroup, setup_error};
use super::process::MpiProcess;
use super::sys::{self, Comm, Failure, Port};
use crate::control::JobControl;
use crate::error::CommError;

/// Bytes of the store's address that rank 0 broadcasts: its port and its host's name.
const STORE_ADDRESS_BYTES: usize = 2 + 256;

impl<B: Backend> MpiGroup<B> {
    /// This process's rank of the job, whichever launcher started it (see the module
    /// documentation): `mpirun` and `srun`, or `zero-run`. A process that no launcher started
    /// is a job of one rank.
    pub fn from_env(options: &MpiOptions) -> Result<Self, CommError> {
        // Open MPI crashes or hangs in MPI_Init when the name server it is pointed at is not
        // there: check first.
        if let Some(uri) = std::env::var_os(SERVER_URI_VAR) {
            check_name_server(&uri.to_string_lossy())?;
        }
        let process = MpiProcess::acquire()?;
        let world = Comm::world();
        let size = world.size().map_err(|f| setup_error(0, f))?;
        if size > 1 {
            return Self::launched_by_mpi(&world, size, options, process);
        }
        let env = match DistEnv::detect() {
            Ok(detected) => detected.env,
            Err(burn_zero_launch::EnvError::NotLaunched) => {
                return Self::alone(&world, options, process);
            }
            Err(error) => return Err(CommError::Rendezvous(error.to_string())),
        };
        if env.world_size == 1 {
            return Self::alone(&world, options, process);
        }
        Self::join_singletons(&env, options, process)
    }

    /// A job of one rank.
    fn alone(
        world: &Comm,
        options: &MpiOptions,
        process: Arc<MpiProcess>,
    ) -> Result<Self, CommError> {
        let comm = world.duplicate().map_err(|f| setup_error(0, f))?;
        MpiGroup::from_parts(
            comm,
            0,
            options.clone(),
            None,
            MpiGroup::<B>::new_family(),
            process,
        )
    }

    /// Every rank in `MPI_COMM_WORLD`, as an MPI launcher started them.
    fn launched_by_mpi(
        world: &Comm,
        size: usize,
        options: &MpiOptions,
        process: Arc<MpiProcess>,
    ) -> Result<Self, CommError> {
        let comm = world.duplicate().map_err(|f| setup_error(0, f))?;
        let rank = comm.rank().map_err(|f| setup_error(0, f))?;
        if let Ok(detected) = DistEnv::detect()
            && (detected.env.rank != rank || detected.env.world_size != size)
        {
            return Err(CommError::InvalidGroup(format!(
                "MPI makes this process rank {rank} of {size}, while {} says rank {} of {}: two \
                 launchers disagree (set BURN_ZERO_LAUNCHER to the one that started the job)",
                detected.source, detected.env.rank, detected.env.world_size
            )));
        }
        let client = store_over_mpi(&comm, rank, size, options.rendezvous_timeout)?;
        tracing::info!(
            rank,
            world_size = size,
            store = client.endpoint(),
            "MPI job joined"
        );
        let control = Arc::new(JobControl::new(
            client,
            options.check_schedule,
            options.timeout,
        ));
        MpiGroup::from_parts(
            comm,
            rank,
            options.clone(),
            Some(control),
            MpiGroup::<B>::new_family(),
            process,
        )
    }

    /// Separately started processes, joined through an MPI port.
    fn join_singletons(
        env: &DistEnv,
        options: &MpiOptions,
        process: Arc<MpiProcess>,
    ) -> Result<Self, CommError> {
        let (rank, world_size) = (env.rank, env.world_size);
        if std::env::var_os(SERVER_URI_VAR).is_none() {
            return Err(CommError::Unavailable(format!(
                "rank {rank} of {world_size} was started as a program of its own, not by an MPI \
                 launcher, and separately started MPI processes meet only through Open MPI's \
                 name server: start the ranks with `mpirun -np {world_size}`, with `srun --mpi=pmix`, \
                 or with zero-run, which runs `ompi-server` for its ranks when Open MPI is \
                 installed and sets {SERVER_URI_VAR}"
            )));
        }
        // One port per joining rank: processes connecting to one port at the same moment can
        // be paired with the wrong accept (seen with Open MPI 4.1), so each has its own and
        // they join in rank order.
        let ports = if rank == 0 {
            (1..world_size)
                .map(|_| Port::open())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|f| setup_error(rank, f))?
        } else {
            Vec::new()
        };
        let names = ports
            .iter()
            .map(|port| port.name().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join("\n")
            .into_bytes();
        let (shared, client) = establish(env, options.rendezvous_timeout, None, || names)
            .map_err(|e| CommError::Rendezvous(e.to_string()))?;
        let control = Arc::new(JobControl::new(
            client,
            options.check_schedule,
            options.timeout,
        ));
        let comm = match connect_all(rank, world_size, ports, &shared) {
            Ok(comm) => comm,
            Err(error) => {
                control.abort(&error.to_string());
                return Err(error);
            }
        };
        tracing::info!(rank, world_size, "separately started MPI processes joined");
        MpiGroup::from_parts(
            comm,
            rank,
            options.clone(),
            Some(control),
            MpiGroup::<B>::new_family(),
            process,
        )
    }
}

/// Whether the name server `uri` (`file:<path>` or the address itself, as Open MPI takes it)
/// answers: its address file exists and its first TCP address accepts a connection.
fn check_name_server(uri: &str) -> Result<(), CommError> {
    let unusable = |why: String| {
        CommError::Unavailable(format!(
            "{SERVER_URI_VAR}={uri}: {why} (Open MPI's name server, which zero-run starts for its \
             ranks, must run while they start)"
        ))
    };
    let address = match uri.strip_prefix("file:") {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| unusable(format!("cannot read {path}: {e}")))?,
        None => uri.to_string(),
    };
    let endpoint = address
        .split(';')
        .find_map(|part| part.trim().strip_prefix("tcp://"))
        .ok_or_else(|| unusable(format!("no tcp:// address in {address:?}")))?;
    let socket: std::net::SocketAddr = endpoint
        .parse()
        .map_err(|_| unusable(format!("{endpoint:?} is not an address")))?;
    std::net::TcpStream::connect_timeout(&socket, Duration::from_secs(5))
        .map(drop)
        .map_err(|e| unusable(format!("the server at {socket} does not answer: {e}")))
}

/// Joins `world_size` singleton processes into one communicator ordered by `rank`: rank `k`
/// connects to rank 0's port `k - 1` (`ports` on rank 0, their names `shared`, one a line, on
/// the others), and every rank already joined takes part in each later accept.
fn connect_all(
    rank: usize,
    world_size: usize,
    ports: Vec<Port>,
    shared: &[u8],
) -> Result<Comm, CommError> {
    let names: Vec<CString> = String::from_utf8_lossy(shared)
        .lines()
        .map(|name| CString::new(name).unwrap_or_default())
        .collect();
    if rank > 0 && names.len() != world_size - 1 {
        return Err(CommError::Rendezvous(format!(
            "rank 0 sent {} MPI port names for {} joining ranks",
            names.len(),
            world_size - 1
        )));
    }
    let mut comm = if rank == 0 {
        Comm::this_process()
    } else {
        // Wait until the ranks before this one joined: each accept takes the next rank.
        Comm::connect(&names[rank - 1]).map_err(|f| setup_error(rank, f))?
    };
    // The accepting side keeps the low ranks, so rank 0 of every merged group is the ports'
    // owner, who names them to MPI.
    let empty = CString::default();
    loop {
        let joined = comm.size().map_err(|f| setup_error(rank, f))?;
        if joined >= world_size {
            break;
        }
        let port = ports.get(joined - 1).map_or(empty.as_c_str(), Port::name);
        comm = comm.accept_one(port, 0).map_err(|f| setup_error(rank, f))?;
    }
    drop(ports);
    let key = i32::try_from(rank).map_err(|_| CommError::InvalidGroup("rank too large".into()))?;
    comm.split(0, key).map_err(|f| setup_error(rank, f))
}

/// The job's control connection in an MPI world: rank 0 starts the store and broadcasts its
/// port and host; the others connect, over the loopback when they run on rank 0's machine.
fn store_over_mpi(
    comm: &Comm,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<ControlClient, CommError> {
    let store_error = |e: burn_zero_launch::ControlError| CommError::Rendezvous(e.to_string());
    let mut address = [0u8; STORE_ADDRESS_BYTES];
    let client = if rank == 0 {
        let client = ControlClient::serve(world_size, timeout).map_err(store_error)?;
        let port = client.store_port().unwrap_or_default();
        let host = sys::processor_name().map_err(|f| setup_error(rank, f))?;
        address[..2].copy_from_slice(&port.to_be_bytes());
        let host = host.as_bytes();
        let len = host.len().min(STORE_ADDRESS_BYTES - 2);
        address[2..2 + len].copy_from_slice(&host[..len]);
        Some(client)
    } else {
        None
    };
    broadcast_blocking(comm, &mut address, timeout).map_err(|f| setup_error(rank, f))?;
    if let Some(client) = client {
        return Ok(client);
    }
    let port = u16::from_be_bytes([address[0], address[1]]);
    let end = address[2..]
        .iter()
        .position(|&b| b == 0)
        .map_or(address.len(), |p| p + 2);
    let host = String::from_utf8_lossy(&address[2..end]).into_owned();
    let reach = if sys::processor_name().is_ok_and(|mine| mine == host) {
        "127.0.0.1".to_string()
    } else {
        host
    };
    ControlClient::connect(&reach, port, rank, world_size, timeout).map_err(store_error)
}

/// Broadcasts `buffer` from rank 0 and waits for it, at most `timeout`.
fn broadcast_blocking(comm: &Comm, buffer: &mut [u8], timeout: Duration) -> Result<(), Failure> {
    let len = sys::count(buffer.len()).unwrap_or(0);
    let mut staged = buffer.to_vec();
    // SAFETY: `staged` lives until the request completes below; on a timeout it is leaked, so
    // that MPI may still write it.
    let mut request = unsafe { comm.broadcast(staged.as_mut_ptr(), len, 0)? };
    let started = Instant::now();
    while !request.test()? {
        if started.elapsed() > timeout {
            // The request is only a handle: MPI keeps the broadcast, which may still write.
            let _ = request;
            std::mem::forget(staged);
            return Err(Failure {
                call: "MPI_Ibcast",
                code: -1,
                text: format!("the other ranks did not join within {timeout:?}"),
            });
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    buffer.copy_from_slice(&staged);
    Ok(())
}
