// MPI as the data path of CPU collectives (HOROVOD_CPU_OPERATIONS=MPI): the core's side of the
// MPI plugin (plugin_api.h). shvd_init starts it when asked for; the dispatcher's MPI rows
// (algorithms/dispatch.cc) then run allreduce, allgather, broadcast, alltoall and
// reducescatter through it on an MPI communicator of each process set's members. Negotiation
// stays the core's own (the coordinator over TCP); only the data moves through MPI.
//
// start and stop run while no engine thread exists; everything else on the engine thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../common/types.h"
#include "../transport/communicator.h"

namespace shvd {
namespace mpi {

// Loads the plugin at `plugin_path` (once per process), checks MPI's state and thread level
// and duplicates the job's communicator (`fortran_comm`, MPI_Comm_c2f of the communicator the
// job was bootstrapped on: collective over it). Throws std::runtime_error saying what is
// missing.
void start(const std::string& plugin_path, int64_t fortran_comm);
// MPI operations end (shutdown): the dispatcher's MPI rows stop applying.
void stop();
// True between start and stop.
bool active();

// Whether the MPI rows can take a collective of `dtype` reduced with `op` (Adasum stays on
// the core's own path).
bool supports(DataType dtype, ReduceOp op);

// The collectives, on the MPI communicator of `comm`'s members (made the first time a set is
// used, collectively by its members). Failures throw PeerLostError.
void allreduce(const Communicator& comm, void* buf, size_t count, DataType dtype, ReduceOp op);
void allgather(const Communicator& comm, void* out, const std::vector<size_t>& bytes);
void broadcast(const Communicator& comm, void* buf, size_t bytes, int root);
void alltoall(const Communicator& comm, const void* in, const std::vector<size_t>& send_bytes,
              void* out, const std::vector<size_t>& recv_bytes);
// `buf` holds every member's full input (counts[i] elements for member i); member i ends with
// its reduced block in place, at its offset in `buf`, as reducescatter_ring leaves it.
void reducescatter(const Communicator& comm, void* buf, const std::vector<size_t>& counts,
                   DataType dtype, ReduceOp op, Scratch& scratch);

}  // namespace mpi
}  // namespace shvd
