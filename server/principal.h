// Who a call is from (docs/security.md "Principals"). No gRPC here: the
// session manager and the cost checks use it; server/auth.h fills it in.
#ifndef ROPEATTN_SERVER_PRINCIPAL_H_
#define ROPEATTN_SERVER_PRINCIPAL_H_

#include <string>

namespace ropeattn::server {

struct Principal {
  // The name from the tokens file or the client certificate; empty for the
  // anonymous principal (no authentication configured: every caller).
  std::string name;
  // May list every session and inspect or close any (never read one).
  bool admin = false;
  // Whether authentication is on for this server (then quotas apply).
  bool authenticated = false;
};

}  // namespace ropeattn::server

#endif  // ROPEATTN_SERVER_PRINCIPAL_H_
