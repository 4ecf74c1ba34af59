//! An HTTP/1.1 server on the node runtime: a listener per node on one port
//! (`SO_REUSEPORT`), each connection served by the workers of the node
//! whose listener accepted it, every response naming that node.
//!
//! ```text
//! cargo run --release -p numaweave-tokio --example http                  # serves 127.0.0.1:8080 until killed
//! cargo run --release -p numaweave-tokio --example http -- --requests 200  # serves a port of its own, asks it 200 times, exits
//! ```
//!
//! `NUMAWEAVE_TOPOLOGY=fake:2` splits a one-node machine's CPUs in two.

use std::convert::Infallible;
use std::net::SocketAddr;

use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use numaweave::NumaAlloc;
use numaweave_tokio::{NodeRuntime, current_node};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

async fn hello(_: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    // A response body allocated on the serving worker's node.
    let node = current_node().map_or_else(|| "?".to_string(), |n| n.to_string());
    Ok(Response::new(Full::new(Bytes::from(format!("hello from node {node}\n")))))
}

fn main() {
    let requests: Option<usize> = std::env::args().skip_while(|a| a != "--requests").nth(1).map(|n| n.parse().unwrap());
    let rt = NodeRuntime::builder().build().expect("the node runtime");
    let addr: SocketAddr = if requests.is_some() { "127.0.0.1:0" } else { "127.0.0.1:8080" }.parse().unwrap();
    let listeners = rt.listen(addr).expect("a listener per node");
    let port = listeners[0].1.local_addr().unwrap().port();
    for (node, listener) in listeners {
        rt.spawn_on(node, async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                // Served by this node's workers, as accepted.
                tokio::spawn(async move {
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service_fn(hello)).await;
                });
            }
        });
    }
    println!("serving on 127.0.0.1:{port}, a listener on each of nodes {:?}", rt.nodes());
    let Some(n) = requests else {
        rt.block_on(std::future::pending::<()>());
        return;
    };
    // The client: its own connection per request, from the calling thread.
    let counts = rt.block_on(async move {
        let mut counts = std::collections::BTreeMap::<String, usize>::new();
        for _ in 0..n {
            let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
            tokio::spawn(conn);
            let req = Request::get("/").body(Empty::<Bytes>::new()).unwrap();
            let body = send.send_request(req).await.unwrap().into_body().collect().await.unwrap().to_bytes();
            *counts.entry(String::from_utf8_lossy(&body).trim().to_string()).or_default() += 1;
        }
        counts
    });
    for (reply, k) in &counts {
        println!("{k:>5} × {reply}");
    }
    assert_eq!(counts.values().sum::<usize>(), n);
    println!("{n} requests answered");
}
