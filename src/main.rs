fn main() {
    println!("lily");
}
