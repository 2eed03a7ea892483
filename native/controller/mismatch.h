// The mismatch diagnosis: from every rank's request for one tensor, the response all of them
// execute, or an error that says which ranks disagree about what ("ranks [0, 2] sent [4, 3];
// ranks [1] sent [5, 3]"), checked in the order a user would fix them (op, process set, dtype,
// group, then the op's own parameters).
#pragma once

#include <string>
#include <vector>

#include "message.h"
#include "process_sets.h"

namespace shvd {

// "[0, 2]".
std::string ranks_str(const std::vector<int>& ranks);

// The error for an op other than allreduce while `joined` ranks have joined (Horovod's rule:
// only allreduce continues after join()).
std::string joined_refusal(OpType op, const std::string& name, const std::vector<int>& joined);

// The response's parameters taken from `first` (the lowest submitting rank's request), with no
// checks: the frame an error response is built in.
Response response_skeleton(const std::string& name, const Request& first,
                           const std::vector<int>& joined);

// The response for `name` from the requests by_rank[r] of the ranks r in `submitted` (ascending,
// not empty): the agreed parameters (allgather's first dimensions and alltoall's splits per
// member of the process set), or an error response (error_is_mismatch) naming the disagreement.
Response agreed_response(const std::string& name, const std::vector<Request>& by_rank,
                         const std::vector<int>& submitted, const std::vector<int>& joined,
                         const ProcessSets& sets);

}  // namespace shvd
