//! [`Endpoints`]: where clients reach the daemon's exports, for the URIs it
//! prints (`attach`, `list`, `status`, the start-up lines). Set once the
//! server has bound its sockets; pure.

use super::uri;
use std::path::PathBuf;

/// Where clients reach the daemon's exports (for the URIs it prints).
#[derive(Debug, Clone, Default)]
pub struct Endpoints {
    pub unix: Option<PathBuf>,
    pub tcp: Vec<String>,
    /// TLS is offered (`nbds` URIs).
    pub tls: bool,
}

impl Endpoints {
    pub fn uris(&self, name: &str) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(p) = &self.unix {
            v.push(uri::unix_uri(self.tls, name, p));
        }
        for t in &self.tcp {
            v.push(uri::tcp_uri(self.tls, t, name));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_list_the_unix_socket_first_then_each_tcp_address() {
        let e = Endpoints {
            unix: Some(PathBuf::from("/run/loopd/nbd.sock")),
            tcp: vec!["127.0.0.1:10809".into(), "[::1]:10809".into()],
            tls: false,
        };
        let u = e.uris("disk");
        assert_eq!(u.len(), 3);
        assert_eq!(
            u[0],
            uri::unix_uri(false, "disk", Path::new("/run/loopd/nbd.sock"))
        );
        assert_eq!(u[1], uri::tcp_uri(false, "127.0.0.1:10809", "disk"));
        assert_eq!(u[2], uri::tcp_uri(false, "[::1]:10809", "disk"));
        assert!(u[0].starts_with("nbd+unix://"), "{}", u[0]);
    }

    #[test]
    fn uris_say_nbds_when_tls_is_offered() {
        let e = Endpoints {
            unix: None,
            tcp: vec!["127.0.0.1:10809".into()],
            tls: true,
        };
        let u = e.uris("disk");
        assert_eq!(u, vec![uri::tcp_uri(true, "127.0.0.1:10809", "disk")]);
        assert!(u[0].starts_with("nbds://"), "{}", u[0]);
    }

    #[test]
    fn no_endpoint_no_uri() {
        assert!(Endpoints::default().uris("disk").is_empty());
    }

    use std::path::Path;
}
